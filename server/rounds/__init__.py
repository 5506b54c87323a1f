"""Rounds: when a round closes, and why (policy), and the state machine it moves through."""
