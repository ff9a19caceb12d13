"""The few mount(2) calls the warm pool needs, through libc (host side, as root)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from corral.backends.host import mountinfo

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 0x2


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, with errno kept (every mount helper of corral goes through it)."""
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


def syscall(nr: int, *args: object) -> int:
    """A raw syscall (the new mount API has no libc wrappers); OSError on failure."""
    result = int(libc().syscall(nr, *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {path}: {os.strerror(err)}", path)


def mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else None
    _check(libc().mount(src, target.encode(), None, flags, None), "mount", target)


def bind(source: str, target: str, *, recursive: bool = True) -> None:
    mount(source, target, MS_BIND | (MS_REC if recursive else 0))


def make_shared(target: str) -> None:
    mount(None, target, MS_SHARED)


def restrict(target: str) -> None:
    """Remount a bind mount nosuid,nodev (the flags bwrap gives its own binds)."""
    mount(None, target, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)


def read_only(target: str) -> None:
    """Remount a bind mount read-only, nosuid and nodev."""
    mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def umount(target: str) -> None:
    """Detach a mount; open files keep working, new lookups no longer see it."""
    _check(libc().umount2(target.encode(), MNT_DETACH), "umount", target)


def is_mountpoint(path: str) -> bool:
    """From /proc/self/mountinfo: ``os.path.ismount`` misses binds within one filesystem."""
    return os.path.realpath(path) in mountinfo.mount_points()


def peel(target: str, limit: int = 16) -> bool:
    """Detach every mount stacked on ``target``; True once nothing is mounted there (or it
    is gone). The kernel says when: umount2 fails with EINVAL on a path that is no mount
    point. :func:`umount_all` and :func:`is_mountpoint` read the whole /proc/self/mountinfo
    before each umount and after: three reads of the mount table per box close. The
    detached mounts go once their last user lets go (MNT_DETACH), as with umount_all."""
    for _ in range(limit):
        try:
            umount(target)
        except OSError as exc:
            return exc.errno in (errno.EINVAL, errno.ENOENT)
    return not is_mountpoint(target)


def umount_all(target: str, limit: int = 16) -> None:
    """Peel every mount stacked on ``target`` (the sweep of a crashed owner)."""
    for _ in range(limit):
        if not is_mountpoint(target):
            return
        try:
            umount(target)
        except OSError:
            return
