"""The volunteer client and the `diloco` command line."""
