"""Checkpoints: the published global model versions, written and served."""
