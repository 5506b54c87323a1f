"""Runs: the run entity, its config and data, status, invites and members."""
