"""The one parser of ``/proc/self/mountinfo`` (proc(5)): cgroup detection, the OCI backend's
view of the host's mounts, and the staging directories' mount checks all read it here.

Each line: ``id parent major:minor root mount_point options [optional fields...] - fstype
source super_options``; paths escape space, tab, newline and backslash as ``\\ooo`` octal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PATH = "/proc/self/mountinfo"


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of ``/proc/self/mountinfo``."""

    mount_point: str
    root: str
    """The path within its filesystem that is mounted (``/`` for a whole filesystem)."""
    fstype: str
    source: str
    options: frozenset[str]
    """Per-mount options (``ro``/``rw``, ``nosuid``, ...)."""
    super_options: frozenset[str]
    """Per-superblock options (on cgroup v1: the controllers of the hierarchy)."""


def unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[Mount]:
    """Every well-formed line of a mountinfo file, in order (malformed lines are skipped)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf = left.split()
        rf = right.split()
        if len(lf) < 6 or len(rf) < 3:
            continue
        mounts.append(
            Mount(
                mount_point=unescape(lf[4]),
                root=unescape(lf[3]),
                fstype=rf[0],
                source=unescape(rf[1]),
                options=frozenset(lf[5].split(",")),
                super_options=frozenset(rf[2].split(",")),
            )
        )
    return mounts


def read(path: str = PATH) -> list[Mount]:
    """The mounts of this process's mount namespace (OSError when ``path`` is unreadable)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse(f.read())


def mount_points(path: str = PATH) -> tuple[str, ...]:
    """Every mount point, in mount order; empty when the file cannot be read."""
    try:
        return tuple(m.mount_point for m in read(path))
    except OSError:
        return ()
