"""Blob storage: the interface, its local-disk and S3 backends, staging blobs as local files
for the close, and serving them.
"""
