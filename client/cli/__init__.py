"""The ``diloco`` command line: thin typer commands over the client library (``client``),
the algorithm (``diloco``) and, where installed, the server.
"""
