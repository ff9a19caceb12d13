"""Where boxes keep their state on the host, and how the orphan sweeps find dead owners'.

Every box has a state directory ``<state>/boxes/<id>`` holding ``owner.json`` (the backend
and the host pid that owns the box, plus what the backend needs to kill it). A box whose
owner died (SIGKILL of the host process) is removed by the next start of its backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from corral import errors

BOX_PREFIX = "cb-"
"""Every box id starts with this; orphan sweeps touch nothing else."""


def state_root() -> Path:
    """Where every backend keeps per-box state (``boxes/<id>``) for the orphan sweep."""
    explicit = os.environ.get("CORRAL_STATE_DIR")
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/run/corral")
    # An ordinary user (rootless): its runtime directory, else its own one in /tmp (the
    # rootless backend refuses one another user made).
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.geteuid():
        return Path(runtime, "corral")
    return Path(f"/tmp/corral-{os.geteuid()}")


def make_private_dir(path: Path) -> None:
    """Make ``path`` (the state root) the user's own, mode 0700, refusing one that another
    user made first (``/tmp`` is shared: a directory planted there would see every box)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise errors.BackendUnavailable(
            f"corral's state directory {path} is not a directory of this user: remove it, or "
            "set CORRAL_STATE_DIR to a directory only you can write"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def cache_root() -> Path:
    """Where derived files that outlive boxes and reboots live (the microVM's kernel,
    initramfs and snapshots): each is keyed on its inputs and rebuilt when they change."""
    explicit = os.environ.get("CORRAL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/var/cache/corral")
    home = os.path.expanduser("~")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    if os.access(cache, os.W_OK) or os.access(home, os.W_OK):
        return Path(cache, "corral")
    return state_root() / "cache"  # a user without a home (a system or CI account)


def pid_alive(pid: int) -> bool:
    """Whether a process exists (the orphan sweeps' test of a box's owner). 0 and negative
    numbers name process groups to kill(2), never a process: not alive (a state dir without
    an owner, such as an empty one, reads as pid 0)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphaned_boxes(backend: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """State dirs of ``backend``'s boxes whose owner process is dead, with their owner.json.

    A dir without a readable owner.json is bwrap's (the oldest format) once it is a minute
    old; a younger one may be a box another process is starting right now."""
    boxes = state_root() / "boxes"
    for entry in boxes.iterdir() if boxes.is_dir() else ():
        try:
            owner = json.loads((entry / "owner.json").read_text())
        except (OSError, ValueError):
            owner = None
        if not isinstance(owner, dict):
            try:
                if time.time() - entry.stat().st_mtime < 60:
                    continue
            except OSError:
                continue
            owner = {}
        if owner.get("backend", "bwrap") != backend:
            continue  # another backend's box: its own sweep knows how to delete it
        if pid_alive(int(owner.get("host_pid", 0) or 0)):
            continue
        yield entry, owner


def write_owner(state_dir: Path, backend: str, **facts: object) -> None:
    """Record who owns a box (this process) and what the sweep needs to end it, in
    ``owner.json``: :func:`orphaned_boxes` reads it back once the owner is dead."""
    owner = {"backend": backend, "host_pid": os.getpid(), **facts, "created": time.time()}
    (state_dir / "owner.json").write_text(json.dumps(owner))


def replace_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``path`` holds ``data``, written whole: into a new file beside it (created, never
    opened through a link a writer could have planted) that is then renamed over ``path``,
    so a reader (a box binding it, another process) sees the old content or the new, never a
    part. Each call has its own temporary name (two writers at once do not meet), removed if
    anything fails."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def boot_id() -> str | None:
    """This boot's id (the kernel's, new at every boot), or None where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def remembered(
    name: str,
    key: dict[str, Any] | None,
    find: Callable[[], Any],
    valid: Callable[[Any], bool] = lambda value: True,
) -> Any:
    """``find()``, kept in the state root as ``name`` under ``key`` (what its answer depends
    on) so that later processes read it instead of finding it again (a host probe a
    ``corral run`` would otherwise pay for on every call). JSON values only. ``key`` None:
    not kept. A record that is another key's, not a regular file of this user (a link), or
    damaged (or whose value is not ``valid``) is not believed: ``find()`` runs and replaces
    it. Blocking."""
    if key is None:
        return find()
    path = state_root() / name
    found = _recalled(path, key)
    if found is not None and valid(found[0]):
        return found[0]
    value = find()
    with contextlib.suppress(OSError):  # best effort: the next process finds it again
        replace_file(path, json.dumps({"key": key, "value": value}).encode())
    return value


def _recalled(path: Path, key: dict[str, Any]) -> tuple[Any] | None:
    """The value kept at ``path`` for ``key`` (in a 1-tuple: it may be None), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 1 << 16:
            return None
        saved = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(saved, dict) or saved.get("key") != key or "value" not in saved:
        return None
    return (saved["value"],)
