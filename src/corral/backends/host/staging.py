"""Staging directories of the warm pool (:mod:`corral.pool`): where a caller's workspace is
bound into an already running box. They hold mounts of users' workspaces in the host's mount
namespace, so they are released with care: unmounted, then ``rmdir`` only, never a recursive
delete. The bwrap backend's orphan sweep calls :func:`sweep_staging` too, so a pool whose
owner was SIGKILLed leaves nothing mounted past the next start of any box."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path

from corral.backends.host import mounts
from corral.backends.host.state import pid_alive, state_root

KINDS = ("pool", "mnt")
"""``pool``: the warm pool's staging dirs; ``mnt``: idmapped mount points of boxes."""


def pool_root() -> Path:
    return state_root() / "pool"


def new_entry(kind: str, name: str) -> Path:
    """``<state>/<kind>/<name>/`` with ``owner.json`` and an empty, world-searchable ``ws``
    (bwrap and OCI runtimes run as unprivileged ids and must reach the mount point)."""
    root = state_root() / kind
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    entry = root / name
    entry.mkdir(mode=0o755)
    entry.chmod(0o755)
    (entry / "owner.json").write_text(json.dumps({"host_pid": os.getpid()}))
    (entry / "ws").mkdir(mode=0o755)
    return entry


def sweep_staging() -> list[str]:
    """Unmount and remove the staging directories and mount points of dead owners."""
    removed: list[str] = []
    entries = [
        e
        for kind in KINDS
        if (state_root() / kind).is_dir()
        for e in (state_root() / kind).iterdir()
    ]
    for entry in entries:
        try:
            owner = json.loads((entry / "owner.json").read_text())
            pid = int(owner.get("host_pid", 0))
        except (OSError, ValueError, AttributeError):
            pid = 0
            if _young(entry):
                continue  # another process is making it now: owner.json comes next
        if pid and pid_alive(pid):
            continue
        if release_staging(entry):
            removed.append(entry.name)
    return removed


def _young(entry: Path) -> bool:
    """Made less than a minute ago (or gone already): not an orphan yet, as for box dirs."""
    try:
        return time.time() - entry.stat().st_mtime < 60
    except OSError:
        return True


def release_staging(entry: Path) -> bool:
    """Peel the mounts off a staging directory and remove it; never deletes contents."""
    ws = entry / "ws"
    if not mounts.peel(str(ws)):
        return False
    with contextlib.suppress(FileNotFoundError):
        (entry / "owner.json").unlink()
    with contextlib.suppress(OSError):
        if ws.is_file() and not ws.is_symlink():
            ws.unlink()  # the mount point of a single file (a runsc bind source)
    if ws.is_dir() and not ws.is_symlink():
        _remove_mount_points(ws)
    for path in (ws, entry):
        try:
            path.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return False  # not empty: something unexpected is in there; leave it alone
    return True


def _remove_mount_points(top: Path, depth: int = 0) -> None:
    """Remove what a runtime made below ``top`` as mount points of a box's binds (a policy's
    ``deny_write: .git`` bound over a workspace not mounted yet leaves an empty ``.git``):
    empty directories and empty files only, never a link followed, 64 levels at most. The
    caller peeled every mount off ``top`` first (a detach takes the mounts below with it).
    Anything else stays (and so does ``top``: the caller's ``rmdir`` then fails)."""
    if depth > 64:
        return
    try:
        with os.scandir(top) as it:
            children = list(it)
    except OSError:
        return
    for child in children:
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue
        path = Path(child.path)
        if stat.S_ISDIR(st.st_mode):
            _remove_mount_points(path, depth + 1)
            with contextlib.suppress(OSError):
                path.rmdir()  # fails while anything is left in it
        elif stat.S_ISREG(st.st_mode) and st.st_size == 0:
            with contextlib.suppress(OSError):
                path.unlink()
