"""Runs: creation (config, data split, checkpoint 0), status, pause/resume/cancel."""
