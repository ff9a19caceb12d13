"""Writable roots on a copy-on-write filesystem: O(1) snapshots and forks of a box's changes.

A box's writable root is an overlay whose upper layer holds what the box changed. On a tmpfs
(the fallback) a snapshot must copy that layer; here the upper is a btrfs *subvolume* of its
own, and a snapshot of a subvolume is O(1) whatever it holds (the kernel shares its extents
until either side writes). So:

* a box's upper is ``boxes/<sandbox id>`` (holding ``upper/`` and ``work/``), made empty, or
  as a writable snapshot of a snapshot's subvolume (a fork, a restore: the box goes on from
  the state it was taken in, nothing copied);
* ``Sandbox.snapshot`` takes a read-only snapshot of it (the box paused meanwhile) as
  ``snaps/<name>``, which the image store records with the image (``ImageRecord.cow``);
* ``filesystem.root_size`` is the subvolume's btrfs qgroup limit on *referenced* bytes (its
  data and metadata, shared or not): a fork of a box that holds 100 MB may write
  ``root_size`` - 100 MB more, as the box itself could (EDQUOT past it);
* a box's subvolume is deleted when the box is released (after its overlay and upper mount
  are gone); a snapshot's when the store forgets its image, or when the store that recorded
  it is gone (a sweep at each process's first use, as for boxes of dead processes).

The subvolume is mounted *idmapped* with the box's own id map (as the image below it is), so
what the box writes is stored with the box's ids (box root's files as uid 0): a fork, whose
namespace owner is another host uid, sees them as the box that wrote them did.

The filesystem is a sparse file (``<cache>/cow.btrfs``, ``CORRAL_COW_SIZE`` bytes, default
half the free space of its filesystem, 8-64 GiB) made with ``mkfs.btrfs`` (Debian's
``btrfs-progs``) on first use and loop-mounted by host root at ``<cache>/cow`` (0700:
nothing in it is reachable but through a box's mounts), with quotas on, without write
barriers: it is a cache of box state. A host crash may cost it (a store that no longer
mounts is set aside and made anew; the images of the snapshots it held then say their changes
are gone: ``corral image rm`` them), never the image store's own layers. Host code never
walks what a box wrote there: subvolumes are made, snapshotted and deleted by ioctls on
their directory; a snapshot is exported (for consumers that need a plain root) by
:mod:`corral.images.export`, which reads it as hostile. Without btrfs (no ``mkfs.btrfs``,
no kernel support, not root, ``CORRAL_COW=0``) writable roots stay on a tmpfs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

from corral.backends.host import mounts
from corral.backends.host.state import cache_root, pid_alive

_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args and _v2 are both 4096 bytes
SUBVOL_CREATE = _ioc(_IOC_WRITE, 14, _VOL_ARGS)
SNAP_DESTROY = _ioc(_IOC_WRITE, 15, _VOL_ARGS)
SNAP_CREATE_V2 = _ioc(_IOC_WRITE, 23, _VOL_ARGS)
QUOTA_CTL = _ioc(_IOC_READ | _IOC_WRITE, 40, 16)
QGROUP_LIMIT = _ioc(_IOC_READ, 43, 48)
_SUBVOL_RDONLY = 1 << 1
_QUOTA_ENABLE = 1
_LIMIT_MAX_RFER = 1
_BTRFS_MAGIC = 0x9123683E
_NAME_MAX = 4039

_lock = threading.Lock()


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if not raw or len(raw) > _NAME_MAX or b"/" in raw:
        raise ValueError(f"bad subvolume name {name!r}")
    buf = bytearray(_VOL_ARGS)
    buf[8 : 8 + len(raw)] = raw
    return buf


def _snap_args(source_fd: int, name: str, readonly: bool) -> bytearray:
    raw = name.encode()
    if not raw or len(raw) > _NAME_MAX or b"/" in raw:
        raise ValueError(f"bad subvolume name {name!r}")
    buf = bytearray(_VOL_ARGS)
    struct.pack_into("qQQ", buf, 0, source_fd, 0, _SUBVOL_RDONLY if readonly else 0)
    buf[56 : 56 + len(raw)] = raw
    return buf


def _dir_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def subvolume(parent: Path, name: str) -> Path:
    """A new empty subvolume ``parent/name``."""
    fd = _dir_fd(parent)
    try:
        fcntl.ioctl(fd, SUBVOL_CREATE, _vol_args(name))
    finally:
        os.close(fd)
    return parent / name


def snapshot(source: Path, parent: Path, name: str, *, readonly: bool) -> Path:
    """``parent/name``: a snapshot of the subvolume ``source`` (O(1))."""
    src = _dir_fd(source)
    try:
        dest = _dir_fd(parent)
        try:
            fcntl.ioctl(dest, SNAP_CREATE_V2, _snap_args(src, name, readonly))
        finally:
            os.close(dest)
    finally:
        os.close(src)
    return parent / name


def delete(parent: Path, name: str) -> None:
    """Delete the subvolume ``parent/name`` (its contents with it, by the kernel: no host
    code walks it). Missing: nothing to do."""
    fd = _dir_fd(parent)
    try:
        fcntl.ioctl(fd, SNAP_DESTROY, _vol_args(name))
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def limit(path: Path, size: int) -> None:
    """Cap the subvolume at ``path`` to ``size`` referenced bytes (its qgroup's limit)."""
    fd = _dir_fd(path)
    try:
        fcntl.ioctl(fd, QGROUP_LIMIT, struct.pack("QQQQQQ", 0, _LIMIT_MAX_RFER, size, 0, 0, 0))
    finally:
        os.close(fd)


def _enable_quota(root: Path) -> None:
    fd = _dir_fd(root)
    try:
        fcntl.ioctl(fd, QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_ENABLE, 0)))
    finally:
        os.close(fd)


def mount_point() -> Path:
    """Beside the file it mounts (``<cache>/cow``): one file, one mount, whatever
    ``CORRAL_STATE_DIR`` two processes have (two loop devices on one file would corrupt it)."""
    return cache_root() / "cow"


def image_file() -> Path:
    return cache_root() / "cow.btrfs"


def _is_btrfs(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        buf = ctypes.create_string_buffer(128)  # struct statfs: f_type first
        if mounts.libc().fstatfs(fd, buf) != 0:
            return False
        return bool(struct.unpack_from("q", buf.raw)[0] == _BTRFS_MAGIC)
    finally:
        os.close(fd)


def _size(file: Path) -> int:
    explicit = os.environ.get("CORRAL_COW_SIZE")
    if explicit:
        return int(explicit)
    st = os.statvfs(file.parent)
    return max(8 << 30, min(64 << 30, st.f_bavail * st.f_frsize // 2))


@functools.cache
def _unusable() -> str | None:
    if os.environ.get("CORRAL_COW", "1") == "0":
        return "CORRAL_COW=0"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("mkfs.btrfs") is None:
        return "no mkfs.btrfs (apt-get install btrfs-progs)"
    try:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1:] == ["btrfs"] for line in f):
                return "the kernel has no btrfs"
    except OSError as exc:
        return str(exc)
    return None


_ready: Path | None = None
_failed: str | None = None


def root() -> Path | None:
    """The mounted store (made and mounted on first use), or None where there is none (the
    caller falls back to a tmpfs). Blocking."""
    global _ready, _failed
    if _ready is not None or _failed is not None or _unusable() is not None:
        return _ready
    with _lock:
        if _ready is None and _failed is None:
            try:
                _ready = _mount()
            except (OSError, subprocess.SubprocessError) as exc:
                _failed = str(exc)  # not tried again by this process: tmpfs uppers
                return None
            sweep()
    return _ready


def _mount() -> Path:
    target = mount_point()
    file = image_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(file.parent / "cow.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process makes and mounts it
        if _is_btrfs(target):
            _cap_dirty(target)
            return target
        try:
            return _cap_dirty(_make_and_mount(file, target))
        except subprocess.CalledProcessError:
            if not file.exists():
                raise
            # Unmountable (a host crash under nobarrier): a cache, made again. Its snapshots'
            # images say their changes are gone; the old file is kept aside, once.
            os.replace(file, file.with_name("cow.btrfs.unmountable"))
            return _cap_dirty(_make_and_mount(file, target))
    finally:
        os.close(lock)


DIRTY_CAP = 32 << 20
"""The most written but not yet written-back data the store holds (its BDI's ``max_bytes``
with ``strict_limit``): a snapshot flushes what is dirty first, so this bounds its cost
(~200 ms after a box wrote 100 MB uncapped, ~15-50 ms capped, measured here); a box writing
faster waits for writeback, as it would on a disk."""


def _cap_dirty(target: Path) -> Path:
    """Cap the dirty data of the btrfs mounted at ``target`` (:data:`DIRTY_CAP`); best
    effort (kernels before 6.2 have no ``max_bytes``)."""
    source = ""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and fields[4] == str(target):
                source = right.split()[1] if len(right.split()) > 1 else ""
    device = os.path.basename(source)
    if not device.startswith("loop"):
        return target
    for fs in Path("/sys/fs/btrfs").glob("*-*"):
        if (fs / "devices" / device).exists():
            bdi = fs / "bdi"
            with contextlib.suppress(OSError):
                (bdi / "strict_limit").write_text("1")
                (bdi / "max_bytes").write_text(str(DIRTY_CAP))
    return target


def _make_and_mount(file: Path, target: Path) -> Path:
    """Format ``file`` when it does not exist yet, and mount it at ``target``."""
    if not file.exists():
        tmp = file.with_name(f"cow.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.truncate(_size(file))
        subprocess.run(
            ["mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", str(tmp)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        tmp.chmod(0o600)
        os.rename(tmp, file)
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o700)
    _loop_mount(file, target)
    target.chmod(0o700)
    for sub in ("boxes", "snaps"):
        (target / sub).mkdir(mode=0o700, exist_ok=True)
    _enable_quota(target)  # idempotent: a no-op when already on
    return target


def _loop_mount(file: Path, target: Path) -> None:
    # nobarrier: a transaction commit (each snapshot) would otherwise fsync the file on the
    # host's disk (7-9 ms of each fork box's start here, 2-3 ms without): the store is a
    # cache, which a host crash may cost (see the module's docstring).
    subprocess.run(
        ["mount", "-o", "loop,noatime,nobarrier,discard=async", str(file), str(target)],
        check=True,
        capture_output=True,
        timeout=60,
    )


# -- boxes -------------------------------------------------------------------------------


def new_box_subvolume(store: Path, sandbox_id: str, seed: Path | None, size: int) -> Path:
    """The subvolume of a box's upper layer: a writable snapshot of ``seed`` (a snapshot's
    subvolume) or a new empty one, capped at ``size`` referenced bytes, with ``upper/`` and
    ``work/`` made by the caller (through the box's idmapped mount). Recorded with this
    process's pid so a crashed owner's is swept."""
    boxes = store / "boxes"
    (boxes / f"{sandbox_id}.json").write_text(json.dumps({"host_pid": os.getpid()}))
    try:
        if seed is not None:
            path = snapshot(seed, boxes, sandbox_id, readonly=False)
        else:
            path = subvolume(boxes, sandbox_id)
        limit(path, size)
    except BaseException:
        release_box(store, sandbox_id)
        raise
    return path


def release_box(store: Path, sandbox_id: str) -> None:
    """Delete a box's subvolume (its mounts gone first) and its record."""
    delete(store / "boxes", sandbox_id)
    with contextlib.suppress(FileNotFoundError):
        (store / "boxes" / f"{sandbox_id}.json").unlink()


def take_snapshot(store: Path, box: Path, name: str, owner: Path, mount_points: list[str]) -> Path:
    """A read-only snapshot of a box's subvolume as ``snaps/name``, recorded as owned by the
    image store at ``owner`` (swept when that store is gone or forgets it), with the
    backend's ``mount_points`` in the upper (not the box's changes)."""
    snaps = store / "snaps"
    meta = {"store": str(owner), "mount_points": mount_points}
    (snaps / f"{name}.json").write_text(json.dumps(meta))
    try:
        return snapshot(box, snaps, name, readonly=True)
    except BaseException:
        (snaps / f"{name}.json").unlink()
        raise


def drop_snapshot(store: Path, name: str) -> None:
    delete(store / "snaps", name)
    with contextlib.suppress(FileNotFoundError):
        (store / "snaps" / f"{name}.json").unlink()


def snapshot_mount_points(name: str) -> frozenset[str]:
    store = root()
    try:
        assert store is not None
        meta = json.loads((store / "snaps" / f"{name}.json").read_text())
        return frozenset(str(p) for p in meta.get("mount_points") or ())
    except (AssertionError, OSError, ValueError, AttributeError):
        return frozenset()


def mounted() -> bool:
    return _ready is not None


def drop_unused(owner: Path, used: set[str]) -> None:
    """Delete the snapshots the image store at ``owner`` recorded and no longer uses."""
    store = _ready
    if store is None:
        return
    for entry in (store / "snaps").glob("*.json"):
        name = entry.name.removesuffix(".json")
        if name in used:
            continue
        try:
            if Path(json.loads(entry.read_text())["store"]) != owner:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        with contextlib.suppress(OSError):
            drop_snapshot(store, name)


def snapshot_path(name: str) -> Path | None:
    """The subvolume of the snapshot ``name`` (mounting the store), or None if gone."""
    store = root()
    if store is None or not name or "/" in name or name.startswith("."):
        return None
    path = store / "snaps" / name
    return path if path.is_dir() else None


def sweep() -> list[str]:
    """Delete the subvolumes of boxes whose process is dead, and of snapshots whose image
    store is gone (or no longer records them)."""
    store = _ready
    removed: list[str] = []
    if store is None:
        return removed
    for entry in (store / "boxes").glob("*.json"):
        try:
            pid = int(json.loads(entry.read_text()).get("host_pid", 0))
        except (OSError, ValueError, AttributeError):
            continue
        if pid and pid_alive(pid):
            continue
        name = entry.name.removesuffix(".json")
        with contextlib.suppress(OSError):
            release_box(store, name)
            removed.append(name)
    recorded: dict[Path, set[str]] = {}  # each image store's refs read once
    for entry in (store / "snaps").glob("*.json"):
        try:
            owner = Path(json.loads(entry.read_text())["store"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        name = entry.name.removesuffix(".json")
        if _young(entry):
            continue  # being taken now: its image is recorded next
        if owner not in recorded:
            recorded[owner] = _recorded(owner)
        if name not in recorded[owner]:
            with contextlib.suppress(OSError):
                drop_snapshot(store, name)
                removed.append(name)
    return removed


def _young(entry: Path) -> bool:
    try:
        return time.time() - entry.stat().st_mtime < 60
    except OSError:
        return True


def _recorded(owner: Path) -> set[str]:
    """The snapshots the image store at ``owner`` records."""
    names: set[str] = set()
    refs = owner / "refs"
    for path in refs.glob("*.json") if refs.is_dir() else ():
        try:
            cow = json.loads(path.read_text()).get("cow")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(cow, str) and cow:
            names.add(cow)
    return names
