"""``python -m corral.cli``: the same as the ``corral`` command."""

from corral.client.cli import console

console()
