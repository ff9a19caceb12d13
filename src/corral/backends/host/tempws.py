"""Temporary workspaces that a box owns (``Sandbox()`` or a pool's claim without a workspace).

Each one is a ``corral-ws-*`` directory in the host's temp directory, recorded under the
state root (``workspaces/<box id>.json``: the owner's pid and the path) while it exists. The
owner removes it when the box closes; when the owner died first (SIGKILL, a crash), the next
start of any box sweeps it (:func:`sweep`), with everything the box wrote in it.

What a box wrote is hostile: the removal never follows a link the box planted (``shutil``'s
fd-based ``rmtree``, which opens each directory relative to its parent with ``O_NOFOLLOW``),
and a record is acted on only if it names a ``corral-ws-*`` directory of this uid that is not
itself a link. The records live in the state root, which no box can write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from corral.backends.host.state import pid_alive, state_root

PREFIX = "corral-ws-"

if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every Linux Python has it
    raise ImportError("corral needs shutil.rmtree's fd-based, symlink-safe removal")


def _records() -> Path:
    return state_root() / "workspaces"


def make(box_id: str, owner: tuple[int, int] | None = None) -> Path:
    """A new empty workspace (mode 0700; ``owner``'s uid and gid, else this process's),
    recorded for the sweep before it is returned."""
    records = _records()
    records.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        if owner is not None:
            os.chown(path, *owner)
        uid = owner[0] if owner is not None else os.getuid()
        record = records / f"{box_id}.json"
        record.write_text(json.dumps({"host_pid": os.getpid(), "path": str(path), "uid": uid}))
    except BaseException:
        os.rmdir(path)
        raise
    return path


def remove(box_id: str, path: Path) -> None:
    """Remove a workspace of :func:`make` with its contents, then its record (kept while
    anything of the workspace is left: a later sweep tries again). Never raises for what
    it cannot remove, as the close it runs in must go on. Blocking."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        with contextlib.suppress(FileNotFoundError):
            (_records() / f"{box_id}.json").unlink()


def sweep() -> list[str]:
    """Remove the workspaces (and records) of owners that are gone; the paths removed."""
    removed: list[str] = []
    records = _records()
    for record in sorted(records.glob("*.json")) if records.is_dir() else ():
        try:
            facts = json.loads(record.read_text())
            pid, path, uid = int(facts["host_pid"]), Path(facts["path"]), int(facts["uid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written right now, or not ours: leave it
        if pid_alive(pid):
            continue
        if _remove_tree(path, uid):
            removed.append(str(path))
        with contextlib.suppress(FileNotFoundError):
            record.unlink()
    return removed


def _remove_tree(path: Path, uid: int) -> bool:
    """``rmtree`` of a recorded workspace, if it still is one (a real directory of ``uid``
    named ``corral-ws-*``: not one another user made under that name since); False when there
    was nothing such to remove."""
    if not (path.is_absolute() and path.name.startswith(PREFIX)):
        return False
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
