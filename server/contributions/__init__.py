"""What contributors did: their record, the leaderboard, and bans that withdraw work."""
