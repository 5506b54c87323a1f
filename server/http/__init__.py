"""HTTP plumbing shared by every domain: errors and their handlers, request limits, request
ids, OpenAPI and its docs page.
"""
