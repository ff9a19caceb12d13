"""``python -m corral.cli``: the same as the ``corral`` command."""

import sys

from corral.client.cli import main

sys.exit(main())
