"""``python -m client.cli``: the ``diloco`` command line."""

from client.cli.main import main

main()
