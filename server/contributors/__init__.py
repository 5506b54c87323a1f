"""Contributors: registration, hashed tokens, the leaderboard."""
