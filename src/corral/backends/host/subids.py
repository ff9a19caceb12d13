"""What an unprivileged user may map into a user namespace: subordinate ids, ``newuidmap``.

The rootless bwrap mode (:mod:`corral.backends.bwrap.rootless`) runs as the invoking user.
The kernel lets such a user map exactly one id (its own) into a namespace it creates; more
need the setuid helpers ``newuidmap``/``newgidmap`` (Debian's ``uidmap``), which map the
ranges ``/etc/subuid`` and ``/etc/subgid`` grant the user, as rootless podman does.

:func:`probe` finds, without starting anything, what this user has and why a box cannot
start: user namespaces disabled (``user.max_user_namespaces = 0``, Debian's
``kernel.unprivileged_userns_clone = 0``, Ubuntu's AppArmor restriction), and each problem's
fix as the exact command root runs once.
"""

from __future__ import annotations

import os
import pwd
import shutil
from dataclasses import dataclass
from pathlib import Path

from corral.backends.layout import SYSTEM_PATH

NO_CGROUP = (
    "rootless: no delegated cgroup for this user, so each command gets an rlimit instead "
    "and the timeout bounds time"
)
SINGLE_ID_WARNING = (
    "rootless without subordinate ids: commands run as the box's root id (no capabilities), "
    "the same id as the guest agent (which is not dumpable: its memory and fds stay out of "
    "reach), so a command can signal the agent (end its own box), and commands keep the "
    "user's supplementary groups; {why}"
)

NEEDED_IDS = 65536
"""Subordinate ids the rootless mode maps (box ids 0..65535 but the user's own)."""


@dataclass(frozen=True, slots=True)
class SubIds:
    """One user's first usable subordinate range for uids and gids, or None each."""

    uid_start: int | None
    uid_count: int
    gid_start: int | None
    gid_count: int


@dataclass(frozen=True, slots=True)
class RootlessProbe:
    """What the rootless mode found for this user."""

    user: str
    uid: int
    gid: int
    userns_problem: str | None
    """Why this user cannot create a user namespace (None: it can), with the fix."""
    newuidmap: str | None
    newgidmap: str | None
    subids: SubIds
    separation_problem: str | None
    """Why commands cannot run as an id of their own (single mapping), with the fix."""

    @property
    def mapped(self) -> bool:
        """Whether commands get a box uid of their own (subordinate ids + the helpers)."""
        return self.separation_problem is None


def _ranges(path: str, user: str, uid: int) -> list[tuple[int, int]]:
    """``(start, count)`` ranges of ``path`` (``/etc/subuid``) for the user, by name or uid."""
    out: list[tuple[int, int]] = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] not in (user, str(uid)):
            continue
        try:
            out.append((int(parts[1]), int(parts[2])))
        except ValueError:
            continue
    return out


def _first_big(ranges: list[tuple[int, int]]) -> tuple[int | None, int]:
    best = next(((s, c) for s, c in ranges if c >= NEEDED_IDS - 1), None)
    if best is None:
        return None, max((c for _, c in ranges), default=0)
    return best


def read_subids(user: str, uid: int) -> SubIds:
    us, uc = _first_big(_ranges("/etc/subuid", user, uid))
    gs, gc = _first_big(_ranges("/etc/subgid", user, uid))
    return SubIds(us, uc, gs, gc)


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def userns_problem() -> str | None:
    """Why an unprivileged user cannot make a user namespace here (with the root command
    that fixes it), or None."""
    if _read_int("/proc/sys/user/max_user_namespaces") == 0:
        return (
            "user namespaces are disabled (user.max_user_namespaces = 0); as root run once: "
            "sysctl -w user.max_user_namespaces=15000"
        )
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        return (
            "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0); "
            "as root run once: sysctl -w kernel.unprivileged_userns_clone=1"
        )
    if _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == 1:
        return (
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns = 1); as root run once: "
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (or give bwrap an "
            "AppArmor profile with 'userns,')"
        )
    return None


def probe() -> RootlessProbe:
    """What this (unprivileged) user can map. Blocking, cheap: a few small files."""
    uid, gid = os.getuid(), os.getgid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    subids = read_subids(user, uid)
    newuidmap = shutil.which("newuidmap", path=SYSTEM_PATH)
    newgidmap = shutil.which("newgidmap", path=SYSTEM_PATH)
    separation: str | None = None
    if newuidmap is None or newgidmap is None:
        separation = (
            "newuidmap/newgidmap are not installed; as root run once: apt-get install uidmap"
        )
    elif subids.uid_start is None or subids.gid_start is None:
        files = (("/etc/subuid", subids.uid_start), ("/etc/subgid", subids.gid_start))
        which = " and ".join(name for name, start in files if start is None)
        separation = (
            f"{user} has no subordinate id range of {NEEDED_IDS - 1}+ ids in {which}; as root run "
            f"once: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}"
        )
    return RootlessProbe(user, uid, gid, userns_problem(), newuidmap, newgidmap, subids, separation)
