"""The files API's bulk bytes, moved by the host through an fd of the very file the box's
agent opened (:mod:`corral.files`).

The agent opens a file as the command user, in the box's view (its masks, read-only binds,
Landlock, the file's modes) and reports the file's ``(st_dev, st_ino)``. The host then opens
the same path beneath the workspace's host directory without following any symlink
(:func:`corral.backends.host.safepath.open_beneath`), never blocking on a FIFO, and uses the fd
only when it holds that same inode: whatever a box does to the path in between (a symlink, a
renamed directory, a FIFO, another file), the host reads or writes a file the box user was
just allowed to, or nothing (the caller goes on through the agent). The file keeps the owner
and mode the agent gave it: the host only appends to it.
"""

from __future__ import annotations

import os
import stat

from corral.backends.host import safepath

Inode = tuple[int, int]
"""``(st_dev, st_ino)`` as the agent saw the file."""


def _open_same(area: str, rel: str, inode: Inode, flags: int) -> int | None:
    """An fd of ``rel`` beneath ``area`` if it is the regular file ``inode``, else None."""
    try:
        fd = safepath.open_beneath(area, rel, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None  # a link, a path that moved, a file this host user may not open...
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != inode:
            os.close(fd)
            return None
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_same(area: str, rel: str, inode: Inode, limit: int) -> bytes | None:
    """Up to ``limit + 1`` bytes of the file from its start (more than ``limit``: the caller's
    FileTooLarge), or None when ``rel`` is not that file any more. One copy, as ``read()``."""
    fd = _open_same(area, rel, inode, os.O_RDONLY)
    if fd is None:
        return None
    cap = limit + 1  # one more than allowed: a file too large (or grown) shows it
    try:
        parts = [os.pread(fd, min(cap, os.fstat(fd).st_size + 1), 0)]
        got = len(parts[0])
        while got < cap and (data := os.pread(fd, min(cap - got, 16 << 20), got)):
            parts.append(data)
            got += len(data)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def append_same(area: str, rel: str, inode: Inode, data: memoryview) -> int | None:
    """Append ``data`` to the file and return its new size; None (nothing written) when
    ``rel`` is not that file any more. An OSError of the write itself (ENOSPC, EFBIG) is
    raised."""
    fd = _open_same(area, rel, inode, os.O_WRONLY | os.O_APPEND)
    if fd is None:
        return None
    try:
        while data:
            n = os.write(fd, data)
            data = data[n:]
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
