"""The bounds of a policy's values and the parsing of sizes, without pydantic: what the
command line checks its flags against before any policy is built (:mod:`corral.policy`
re-exports every name)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def check_size(value: int) -> int:
    """``value``, a size a policy takes (at most :data:`MAX_SIZE`), or a clear error."""
    if value > MAX_SIZE:
        raise ValueError(f"more than 8 PiB ({MAX_SIZE} bytes), the largest size a policy takes")
    return value


def parse_size(value: object) -> object:
    """``"512M"`` -> 536870912; ints pass through; anything else is left for pydantic."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"not a size: {value!r} (use bytes or a suffix: 64K, 512M, 2G)")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return value


# The smallest limits a box can start with, checked here so that no backend discovers them at
# start. Measured on bwrap, runc and crun (``bench``-style loops over the values): an idle box
# (the guest agent) uses about 8 MiB, 8 MiB starts it and runs ``true``, a Python one-liner
# needs 12 MiB; below that the OOM killer takes the agent itself.
MIN_MEMORY_BYTES = 16 << 20
CPU_PERIOD_US = 100_000
"""The CFS period every backend uses: ``cpu_quota`` cores = quota/period."""
MIN_CPU_QUOTA = 0.01
"""The kernel refuses a CFS quota below 1 ms per period: 1 ms / 100 ms = 0.01 cores."""
MAX_CPU_QUOTA = 4096.0
MIN_PIDS = 4
"""The guest agent plus a shell running a two-command pipeline (measured: with 3, the
shell's second fork fails)."""
MAX_PIDS = 4194304
"""The kernel's PID_MAX_LIMIT (64-bit): no pids cgroup takes more, no host has more pids."""
MAX_RLIMIT = (1 << 63) - 1
"""The largest rlimit the guest agent can set (a signed 64-bit count)."""
MAX_SIZE = 1 << 53
"""The largest size a policy takes (8 PiB): more than any machine's memory or disk, and a
number every backend's units hold exactly (a cgroup's 64-bit byte count wraps a larger one
silently; OCI's signed 64-bit fields refuse it only when the runtime starts)."""
