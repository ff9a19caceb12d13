"""An overlay upper directory as an OCI layer: how a box's writable root becomes an image.

A snapshot captures what a box changed above its image: overlayfs's upper directory. This
module writes it as an OCI layer tar that :meth:`corral.images.store.ImageStore.commit` puts
on top of the image, converting overlayfs's own markers to OCI whiteouts:

* a character device 0/0 (a deleted file or directory) becomes ``.wh.NAME``;
* a directory marked opaque (xattr ``trusted.overlay.opaque`` or ``user.overlay.opaque`` =
  ``y``: it replaced a lower directory) gets a ``.wh..wh..opq`` entry first.

The upper directory was written by the box: hostile. It is walked by directory fds with
``O_NOFOLLOW`` (a symlink is stored as a symlink, never followed; nothing outside is read), a
file is read through the fd that was checked to be a regular file, and a file that shrinks
while it is read is padded with zeros to the size taken (grows: cut there) so the tar stays
well-formed. Sockets and other device nodes are left out; setuid/setgid bits are dropped.
Hard links inside the upper directory are stored as hard links.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable, Collection
from typing import IO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")


class _Exactly(io.RawIOBase):
    """``size`` bytes of a file: zeros after an early end, nothing past ``size``."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self._f, self._left = f, size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        want = min(len(buf), self._left)
        if want <= 0:
            return 0
        data = self._f.read(want) or bytes(want)
        buf[: len(data)] = data
        self._left -= len(data)
        return len(data)


def _opaque(fd: int) -> bool:
    for name in _OPAQUE_XATTRS:
        try:
            if os.getxattr(fd, name) == b"y":
                return True
        except OSError:
            continue
    return False


def write_layer(
    upper: str | os.PathLike[str],
    out: IO[bytes],
    box_id: Callable[[int], int] | None = None,
    skip: Collection[str] = (),
    skip_ids: Collection[tuple[int, int]] = (),
) -> int:
    """Write ``upper`` (an overlay upper directory) to ``out`` as an uncompressed OCI layer
    tar; return the number of entries. ``box_id`` maps the host uids and gids the upper's
    files have to the ids the layer records (a box's: ``RootLayer.box_id``); ``skip``
    names entries left out, relative (a box's own mount points); ``skip_ids`` the
    ``(st_dev, st_ino)`` of objects left out wherever they are, under any name or link (a
    box's masked files and directories, with all they hold)."""
    ids = box_id or (lambda host: host)
    root = os.open(upper, _DIR_FLAGS)
    count = 0
    links: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:

        def walk(dir_fd: int, prefix: str) -> None:
            nonlocal count
            for name in sorted(os.listdir(dir_fd)):
                path = f"{prefix}{name}"
                if path in skip:
                    continue
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) in skip_ids:
                    continue
                info = tarfile.TarInfo(path)
                info.mode = stat.S_IMODE(st.st_mode) & 0o1777
                info.uid, info.gid, info.mtime = ids(st.st_uid), ids(st.st_gid), int(st.st_mtime)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    tar.addfile(tarfile.TarInfo(f"{prefix}.wh.{name}"))
                elif stat.S_ISDIR(st.st_mode):
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        info.type = tarfile.DIRTYPE
                        tar.addfile(info)
                        if _opaque(fd):
                            tar.addfile(tarfile.TarInfo(f"{path}/.wh..wh..opq"))
                        walk(fd, f"{path}/")
                    finally:
                        os.close(fd)
                elif stat.S_ISLNK(st.st_mode):
                    info.type = tarfile.SYMTYPE
                    info.linkname = os.readlink(name, dir_fd=dir_fd)
                    tar.addfile(info)
                elif stat.S_ISFIFO(st.st_mode):
                    info.type = tarfile.FIFOTYPE
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    key = (st.st_dev, st.st_ino)
                    if st.st_nlink > 1 and key in links:
                        info.type, info.linkname = tarfile.LNKTYPE, links[key]
                        tar.addfile(info)
                    elif _add_file(tar, info, dir_fd, name):
                        links[key] = path
                    else:
                        continue
                else:
                    continue  # sockets, device nodes
                count += 1

        try:
            walk(root, "")
        finally:
            os.close(root)
    return count


def _add_file(tar: tarfile.TarFile, info: tarfile.TarInfo, dir_fd: int, name: str) -> bool:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # swapped since the stat: leave it out
            return False
        info.size = st.st_size
        tar.addfile(info, io.BufferedReader(_Exactly(f, st.st_size)))
    return True
