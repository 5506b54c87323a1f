"""Contributors: the volunteer's row, registration, hashed tokens, bans (the leaderboard and
one's record: ``server.contributions``)."""
