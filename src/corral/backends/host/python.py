"""The interpreter that runs the guest agent."""

from __future__ import annotations

import os
import sys


def find_python() -> str:
    """The real interpreter for the agent: Debian's, never a pyenv shim (80 ms vs 18 ms)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)
