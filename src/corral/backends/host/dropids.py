"""Running a host command as another uid without forking the caller's whole process.

``subprocess`` switches users (``user=``, ``group=``, ``extra_groups=``) in a *forked*
child: with those arguments CPython cannot use ``vfork``, and its ``fork`` copies the page
tables of the whole calling process while holding the GIL. In a process that holds many boxes
(``corral serve``, a test session) that took 30-180 ms, during which no thread of the process,
the event loop's included, ran a line. A small exec'd program that drops the ids itself lets
``subprocess`` use ``vfork`` (microseconds, whatever the caller's size).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess

from corral.backends.host.state import remembered
from corral.backends.layout import SYSTEM_PATH

__all__ = ["as_ids", "as_uid", "id_dropper"]


@functools.cache
def id_dropper() -> tuple[str, str] | None:
    """("unshare", path) or ("setpriv", path): the program that runs the rest of a command
    line as ``uid:uid`` with no supplementary groups. util-linux ``unshare --setgid
    --setuid`` without namespace flags is setgroups(0), setgid, setuid, exec, with numeric
    ids (no NSS lookup: ~1 ms less than ``setpriv``, whose ``--reuid`` looks the id up as a
    user name first). None if neither is on the system path. Blocking once per process;
    whether ``unshare`` can is kept in the state root for the next (:func:`.state.remembered`)."""
    unshare = shutil.which("unshare", path=SYSTEM_PATH)
    if unshare is not None and remembered(
        "unshare-sets-ids.json", _program_key(unshare), lambda: _sets_ids(unshare), _is_bool
    ):
        return ("unshare", unshare)
    setpriv = shutil.which("setpriv", path=SYSTEM_PATH)
    return ("setpriv", setpriv) if setpriv is not None else None


def _sets_ids(unshare: str) -> bool:
    """Whether this ``unshare`` has ``--setuid`` and ``--setgid`` (util-linux 2.32 and
    later): its ``--help`` says (3 ms a process: kept per program, see below)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        usage = subprocess.run(
            [unshare, "--help"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
        return "--setuid" in usage and "--setgid" in usage
    return False


def _program_key(path: str) -> dict[str, object] | None:
    """What a program's answer depends on: the very file (replaced by an upgrade)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": path, "ino": st.st_ino, "size": st.st_size, "mtime": st.st_mtime_ns}


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def as_uid(uid: int) -> tuple[str, ...] | None:
    """The argv prefix that runs the rest as ``uid:uid`` with no groups, or None (then the
    caller falls back to ``subprocess``'s own, forking, ``user=``/``group=``)."""
    return as_ids(uid, uid)


def as_ids(uid: int, gid: int, groups: tuple[int, ...] = ()) -> tuple[str, ...] | None:
    """The argv prefix that runs the rest as ``uid``, ``gid`` and exactly the supplementary
    ``groups``, or None (the caller falls back to ``user=``/``group=``/``extra_groups=``).
    Supplementary groups need ``setpriv``; ``unshare`` clears them."""
    found = id_dropper()
    if found is None:
        return None
    kind, path = found
    if kind == "unshare" and not groups:
        return (path, f"--setgid={gid}", f"--setuid={uid}", "--")
    if kind == "unshare":
        setpriv = shutil.which("setpriv", path=SYSTEM_PATH)
        if setpriv is None:
            return None
        path = setpriv
    listed = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return (path, f"--reuid={uid}", f"--regid={gid}", listed, "--")
