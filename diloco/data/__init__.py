"""Data: a text file or a prepared dataset (token shards, validation set, manifest) becomes
the batches each worker trains on.
"""
