"""``python -m corral``: the same as the ``corral`` command."""

from corral.client.cli import console

console()
