"""Idmapped mounts: the workspace (and other shared host paths) as the box's user sees them.

Commands run as box uid 1000, which maps to an unprivileged host uid of the box's own
(:func:`corral.backends.users.command_id`; ``COMMAND_HOST_ID`` where a box has no owner slot):
outside what is shared, they are nobody in particular on the host, even when the workspace
belongs to root. The workspace itself is mounted *idmapped* (Linux 5.12+): files
its owner holds on disk appear inside as the box user's, and what the box user creates lands on
disk as the owner's. So a command can edit the workspace but cannot read a root-only host file.

The idmapped mounts are made by the host before the box starts, at
``<state>/mnt/<box id>.<n>/ws`` (world-searchable, so bwrap or the OCI runtime, which run as
unprivileged ids, can reach them), and are released like the pool's staging directories:
unmounted, then ``rmdir`` only, never a recursive delete.

Where idmapped mounts are not available (an old kernel, a filesystem without support), the
backend falls back to mapping the box user to the workspace owner, and says so in the box's
warnings. It never maps the box user to host root: a workspace owned by root (uid or gid 0)
that cannot be idmapped is refused (:func:`owner_ids`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral import errors
from corral.backends.base import BoxSpec
from corral.backends.host import mounts, safepath, staging
from corral.backends.host.state import boot_id, remembered, state_root
from corral.backends.layout import expand
from corral.backends.users import COMMAND_HOST_ID, HOST_UID_BASE

_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x0010_0000

_lock = threading.Lock()
_probe_lock = threading.Lock()
_userns: dict[tuple[int, int, bool, int], int] = {}


def _syscall_for(path: str, nr: int, *args: object) -> int:
    """A mount syscall whose error names the path it was about."""
    try:
        return mounts.syscall(nr, *args)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None


FOREIGN_BASE = 3_000_000_000
"""On-disk ids other than the owner's (another host user's files in the workspace) appear
on an idmapped mount as ``FOREIGN_BASE + id``: a host id nobody holds, mapped in no box
(so a box shows them as nobody, 65534), but valid, so the box user may delete or rename them
where it may write the directory, as any user may on the host. Unmapped, the kernel refused
that with EOVERFLOW ("Value too large for defined data type")."""
FOREIGN_COUNT = 1_000_000_000
"""On-disk ids below this are mapped so (ids above it stay unmapped: EOVERFLOW)."""


def id_map_text(owner: int, box_root: bool = False, user: int = COMMAND_HOST_ID) -> str:
    """uid_map/gid_map text of an idmapped mount's namespace: on-disk ``owner`` -> ``user``
    (the box user's host id), ``box_root``: HOST_UID_BASE -> itself (see :func:`userns_fd`),
    every other on-disk id below :data:`FOREIGN_COUNT` -> :data:`FOREIGN_BASE` + id."""
    special = {owner: user}
    if box_root:
        special[HOST_UID_BASE] = HOST_UID_BASE
    lines = [f"{inside} {outside} 1\n" for inside, outside in sorted(special.items())]
    start = 0
    for inside in [*sorted(i for i in special if i < FOREIGN_COUNT), FOREIGN_COUNT]:
        if inside > start:
            lines.append(f"{start} {FOREIGN_BASE + start} {inside - start}\n")
        start = inside + 1
    return "".join(lines)


def userns_fd(uid: int, gid: int, box_root: bool = False, user: int = COMMAND_HOST_ID) -> int:
    """A user namespace mapping on-disk ``uid``/``gid`` to ``user`` (the box user's host uid
    and gid), and other on-disk ids to :data:`FOREIGN_BASE` + id.

    ``box_root``: on-disk HOST_UID_BASE maps to itself too, so the box's root may create
    files (gVisor's file server, box root, creates every file, then chowns it to its creator:
    the box user's land as the owner's, box root's as HOST_UID_BASE, never host root).

    Cached for the life of the process, one open fd per workspace owner and box user id
    (bounded by the owners times the most boxes that ran at once: owner slots are reused
    lowest first): making one costs a short-lived ``unshare`` process."""
    key = (uid, gid, box_root, user)
    with _lock:
        fd = _userns.get(key)
        if fd is not None:
            return fd
        fd = _unshared_userns(id_map_text(uid, box_root, user), id_map_text(gid, box_root, user))
        _userns[key] = fd
        return fd


def cached_namespace_fds() -> frozenset[int]:
    """The fds :func:`userns_fd` keeps open for the life of the process (its cache: one per
    workspace owner and box user host id in use; not a leak)."""
    with _lock:
        return frozenset([*_userns.values(), *_box_userns.values()])


_box_userns: dict[tuple[str, str], int] = {}


def box_userns_fd(uid_map: str, gid_map: str) -> int:
    """A user namespace with a box's own id maps (``users.id_map``): an idmapped mount made
    with it shows a tree's on-disk ids inside that box as they are on disk (an image's root
    files are box root's, its uid 1000 files the box user's). Cached for the life of the
    process, one per namespace owner slot in use (its lowest ids are reused first)."""
    key = (uid_map, gid_map)
    with _lock:
        fd = _box_userns.get(key)
        if fd is None:
            fd = _box_userns[key] = _unshared_userns(uid_map, gid_map)
        return fd


def _unshared_userns(uid_map: str, gid_map: str) -> int:
    proc = subprocess.Popen(
        ["unshare", "--user", "--", "/bin/sh", "-c", "echo; exec cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if not proc.stdout.readline():
            raise OSError(f"unshare --user failed (exit {proc.wait()})")
        Path(f"/proc/{proc.pid}/uid_map").write_text(uid_map)
        Path(f"/proc/{proc.pid}/gid_map").write_text(gid_map)
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def mount_tree(source_fd: int, name: str, target: str, ns_fd: int, attrs: int) -> None:
    """Clone the tree open at ``source_fd`` (recursively) and attach it at ``target`` with
    the mount attributes ``attrs`` (``MOUNT_ATTR_*``), idmapped through the user namespace
    ``ns_fd``. ``name`` names the source in errors."""
    tree = _syscall_for(
        name,
        _SYS_OPEN_TREE,
        ctypes.c_int(source_fd),
        b"",
        ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE | _AT_EMPTY_PATH),
    )
    try:
        attr = struct.pack("QQQQ", _MOUNT_ATTR_IDMAP | attrs, 0, 0, ns_fd)
        buf = ctypes.create_string_buffer(attr, len(attr))
        _syscall_for(
            name,
            _SYS_MOUNT_SETATTR,
            ctypes.c_int(tree),
            b"",
            ctypes.c_uint(_AT_EMPTY_PATH | _AT_RECURSIVE),
            buf,
            ctypes.c_size_t(len(attr)),
        )
        _syscall_for(
            target,
            _SYS_MOVE_MOUNT,
            ctypes.c_int(tree),
            b"",
            ctypes.c_int(_AT_FDCWD),
            os.fsencode(target),
            ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
        )
    finally:
        os.close(tree)


def mount_idmapped(
    source: str,
    target: str,
    box_root: bool = False,
    areas: tuple[str, ...] = (),
    user: int = COMMAND_HOST_ID,
) -> None:
    """Mount ``source`` (recursively, nosuid, nodev) at ``target``, its owner's files
    appearing as host id ``user``'s, the box user's (``box_root``: see :func:`userns_fd`).

    The source is opened first (beneath its writable area without following any symlink
    when it lies in one of ``areas``: :mod:`corral.backends.host.safepath`) and the tree is
    cloned from that fd, so a path a box swapped cannot redirect the mount."""
    src_fd = safepath.open_path(source, os.O_PATH | os.O_DIRECTORY, areas)
    try:
        st = os.fstat(src_fd)
        ns_fd = userns_fd(st.st_uid, st.st_gid, box_root, user)
        mount_tree(src_fd, source, target, ns_fd, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    finally:
        os.close(src_fd)


VERDICT_FILE = "idmap-probe.json"
"""In the state root: the probe's answer for this boot, kernel and state filesystem."""


@functools.cache
def unsupported_reason() -> str | None:
    """Why idmapped mounts can't be used here, or None. Probed once per boot: the answer is
    kept in the state root (:data:`VERDICT_FILE`, :func:`.state.remembered`) and a later
    process reads it instead of mounting again (the probe takes ~7 ms, mostly the kernel's
    wait in its unmount: a tenth of a `corral run`'s box start)."""
    # The cache does not keep two threads from a first call at once (a pool filling in a
    # thread while a sandbox starts): they probe one after the other, never on one entry.
    with _probe_lock:
        reason: str | None = remembered(
            VERDICT_FILE,
            _verdict_key(),
            _probe,
            lambda saved: saved is None or isinstance(saved, str),
        )
        return reason


def _verdict_key() -> dict[str, object] | None:
    """What the probe's answer depends on: the boot (the kernel, its features and sysctls)
    and the filesystem the idmapped mounts are staged on. None when it cannot be told."""
    boot = boot_id()
    if boot is None:
        return None
    try:
        device = os.stat(state_root()).st_dev
    except OSError:
        return None
    return {"boot": boot, "kernel": os.uname().release, "device": device}


def _probe() -> str | None:
    probe = staging.new_entry("mnt", f"probe-{os.getpid()}")
    try:
        source = probe / "src"
        source.mkdir()
        mount_idmapped(str(source), str(probe / "ws"))
    except (OSError, AssertionError) as exc:
        return f"idmapped mounts are not available ({exc}); commands act as the workspace owner"
    finally:
        with contextlib.suppress(OSError):
            (probe / "src").rmdir()
        staging.release_staging(probe)
    return None


class IdmappedBinds:
    """The idmapped mount points of one box; ``release`` after the box is gone."""

    def __init__(
        self,
        sandbox_id: str,
        box_root: bool = False,
        areas: tuple[str, ...] = (),
        user: int = COMMAND_HOST_ID,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.box_root = box_root
        self.user = user
        """The box user's host id, which the owner's files appear as."""
        self.areas = areas
        """Writable areas: a source inside one is opened following no symlink."""
        self.entries: list[Path] = []
        self.after: list[Callable[[], None]] = []
        """Run once the entries are released (a writable root's subvolume is deleted)."""

    def add(self, source: str | os.PathLike[str]) -> Path:
        entry = staging.new_entry("mnt", f"{self.sandbox_id}.{len(self.entries)}")
        self.entries.append(entry)
        mount_idmapped(os.fspath(source), str(entry / "ws"), self.box_root, self.areas, self.user)
        return entry / "ws"

    def release(self) -> None:
        for entry in self.entries:
            staging.release_staging(entry)
        self.entries.clear()
        for then in self.after:
            with contextlib.suppress(OSError):
                then()
        self.after.clear()


@dataclass
class SharedPaths:
    """What a backend binds for the policy's shared host paths, and who commands are."""

    workspace: Path
    """Bound at the workdir: the idmapped mount point (or the workspace itself)."""
    sources: dict[str, str] = field(default_factory=dict)
    """``allow_write`` and ``mounts`` host paths -> their idmapped mount points."""
    uid: int = COMMAND_HOST_ID
    gid: int = COMMAND_HOST_ID
    """Host ids of box uid/gid 1000."""
    binds: IdmappedBinds | None = None
    warning: str | None = None

    def release(self) -> None:
        if self.binds is not None:
            self.binds.release()


def owner_ids(workspace: Path, why: str) -> tuple[int, int]:
    """The workspace owner's host ids, which the box user becomes when idmapping is not
    possible; refused when that would make the box user host root."""
    st = workspace.stat()
    if st.st_uid == 0 or st.st_gid == 0:
        raise errors.BackendError(
            f"{why}, and the workspace {workspace} belongs to root: corral does not run the "
            "box user as host root. Use a workspace owned by an unprivileged user "
            f"(e.g. chown 1000:1000 {workspace}) on a filesystem that supports idmapped mounts"
        )
    return st.st_uid, st.st_gid


def share_paths(
    spec: BoxSpec, home: str | None = None, box_root: bool = False, user: int = COMMAND_HOST_ID
) -> SharedPaths:
    """Idmap the workspace, ``allow_write`` paths and ``mounts`` of a box about to start
    (``box_root``: writable by the box's root too, see :func:`userns_fd`), their owner's
    files appearing as ``user``'s: the box user's host id (``users.command_id``).

    Falls back to mapping the box user to the workspace owner where idmapped mounts are not
    available (the reason becomes a warning of the box)."""
    reason = unsupported_reason()
    if reason is not None:
        uid, gid = owner_ids(spec.workspace, reason)
        return SharedPaths(spec.workspace, uid=uid, gid=gid, warning=reason)
    fs = spec.policy.filesystem
    home = home or os.path.expanduser("~")
    binds = IdmappedBinds(spec.sandbox_id, box_root, (str(spec.workspace),), user)
    try:
        # A warm pool's box: its workspace is a staging directory the pool mounts an
        # idmapped workspace on when claimed; the other shared paths are idmapped now.
        workspace = spec.workspace if spec.workspace_prepared else binds.add(spec.workspace)
        shared = SharedPaths(workspace, uid=user, gid=user, binds=binds)
        for raw in fs.allow_write:
            path = expand(raw, home)
            if os.path.isdir(path):
                shared.sources[path] = str(binds.add(path))
        for mount in fs.mounts:
            if safepath.is_dir(mount.host, binds.areas):
                shared.sources[str(mount.host)] = str(binds.add(mount.host))
    except OSError as exc:
        # A path this filesystem can't idmap (or holding a mount that already is): the box
        # still starts, with the box user mapped to the workspace owner, and says so.
        binds.release()
        why = f"{exc.strerror or exc} while idmapping {exc.filename or 'a shared path'}"
        uid, gid = owner_ids(spec.workspace, f"idmapped mounts failed ({why})")
        warning = f"idmapped mounts failed ({why}); commands act as the workspace owner"
        return SharedPaths(spec.workspace, uid=uid, gid=gid, warning=warning)
    except BaseException:
        binds.release()
        raise
    return shared
