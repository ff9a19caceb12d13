"""File operations of the guest agent, confined beneath a root with ``openat2``.

The host has already checked every path lexically (no ``..`` out of the root, no absolute
path outside what the policy grants). What the host cannot see is the box's own symlinks,
and a command could swap one in between a check and a use. So every path is opened here
with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` relative to the root's fd: the
kernel refuses, atomically, any resolution that leaves the root, whatever the symlinks say.

Operations run with the effective uid/gid of the box's command user, so the kernel's own
permission checks apply exactly as they would to a command.
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False  # the guest agent does not import typing (see agent.py)
if TYPE_CHECKING:
    from collections.abc import Iterator

    from corral.agent import lean, protocol
elif __package__:  # the host (tests of the user-space RESOLVE_BENEATH): corral.agent.files
    from corral.agent import lean, protocol
else:  # inside the box: sibling modules
    import lean  # its contextmanager: contextlib's import costs the agent's start ~5 ms
    import protocol

SYS_OPENAT2 = 437  # the same number on every architecture (new-style syscall table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
MAX_READ = 15 << 20
MAX_ENTRIES = 10000


@lean.contextmanager
def as_user(uid: int, gid: int) -> Iterator[None]:
    """Take the command user's effective ids for a moment, then the agent's back.

    The agent holds no DAC override and no CAP_KILL: files, working directories and signals
    are checked by the kernel as the command user would see them. The saved uid stays 0,
    so the agent can return.
    """
    os.setegid(gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def make_home(path: str, uid: int, gid: int) -> None:
    """Make the command user's home, owned by it and 0755, where the backend could not (a
    bwrap tmpfs belongs to the box's root, and the agent has no CAP_CHOWN): created as that
    user in its parent (the agent's, opened to it for the moment: no command runs yet).
    Where it exists it is the user's (OCI, microVM), or bwrap made it, box root's, for a
    bind below it (``-v DATA:/home/user/data``): then it is opened to the user (0777), as a
    home the user cannot write breaks every tool that keeps state there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if st.st_uid != uid and st.st_uid == os.geteuid():
            os.chmod(path, 0o777)
        return
    parent = os.path.dirname(path)
    mode = os.stat(parent).st_mode & 0o7777
    os.chmod(parent, 0o777)
    try:
        with as_user(uid, gid):
            os.mkdir(path, 0o755)
            os.chmod(path, 0o755)  # whatever the umask
    finally:
        os.chmod(parent, mode)


class FileOpFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Openat2:
    """Lazily built ctypes binding (ctypes costs start-up time; most boxes never need it)."""

    def __init__(self) -> None:
        import ctypes

        class OpenHow(ctypes.Structure):
            _fields_ = [
                ("flags", ctypes.c_uint64),
                ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64),
            ]

        self.ctypes = ctypes
        self.how_type = OpenHow
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def open(
        self, dirfd: int, rel: str, flags: int, mode: int = 0, no_symlinks: bool = False
    ) -> int:
        """``rel`` beneath ``dirfd``; with ``no_symlinks`` no symlink is followed at all (the
        host's opens of paths a box can change: :mod:`corral.backends.host.safepath`)."""
        if self.missing:
            return open_beneath(dirfd, rel, flags, mode, no_symlinks)
        resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
        if no_symlinks:
            resolve |= RESOLVE_NO_SYMLINKS
        how = self.how_type(flags | os.O_CLOEXEC, mode, resolve)
        fd = self.libc.syscall(
            SYS_OPENAT2, dirfd, os.fsencode(rel), self.ctypes.byref(how), self.ctypes.sizeof(how)
        )
        if fd < 0:
            err = self.ctypes.get_errno()
            if err == errno.ENOSYS:  # gVisor before 2023: resolve in user space instead
                self.missing = True
                return open_beneath(dirfd, rel, flags, mode, no_symlinks)
            raise OSError(err, os.strerror(err), rel)
        return int(fd)

    missing = False
    """openat2 is not implemented here (ENOSYS once): :func:`open_beneath` does its work."""


MAX_SYMLINKS = 40


def _open_component(dirfd: int, name: str, flags: int | None, mode: int) -> int:
    """``name`` in ``dirfd`` without following it (``flags`` None: a directory to walk
    through), or -1 when it may be a symlink for the caller to read."""
    step = os.O_PATH | os.O_DIRECTORY if flags is None else flags
    try:
        fd = os.open(name, step | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        return -1
    if stat.S_ISLNK(os.fstat(fd).st_mode):
        os.close(fd)  # O_PATH | O_NOFOLLOW opened the symlink itself
        return -1
    return fd


def open_beneath(
    root_fd: int, rel: str, flags: int, mode: int = 0, no_symlinks: bool = False
) -> int:
    """``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` done one component at a time
    (with ``no_symlinks``, ``RESOLVE_NO_SYMLINKS`` too: any symlink fails with ELOOP).

    Every component is opened with O_NOFOLLOW relative to the fd of the directory before it,
    so nothing a command renames or swaps meanwhile can redirect the walk. A symlink is read
    with ``readlinkat`` and its target walked the same way; ``..`` returns to the fd of the
    directory before (never opens ``..``), and, like RESOLVE_BENEATH, climbing above the
    root or an absolute symlink fails with EXDEV, more than 40 symlinks with ELOOP.
    """
    parts = [p for p in rel.split("/") if p and p != "."]
    stack = [os.dup(root_fd)]  # the directories walked so far, root first
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                if len(stack) == 1:
                    raise OSError(errno.EXDEV, "path resolves outside the root", rel)
                os.close(stack.pop())
                continue
            last = not parts
            fd = _open_component(stack[-1], name, flags if last else None, mode)
            if fd >= 0:
                if last:
                    return fd
                stack.append(fd)
                continue
            try:
                target = os.readlink(name, dir_fd=stack[-1])
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # not a symlink: O_NOFOLLOW refused a non-dir
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), rel) from None
                raise
            if no_symlinks or (last and flags & os.O_NOFOLLOW):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)
            if target.startswith("/"):
                raise OSError(errno.EXDEV, "absolute symlink leaves the root", rel)
            parts = [p for p in target.split("/") if p and p != "."] + parts
        return os.dup(stack[-1]) if flags & os.O_PATH else os.open(".", flags, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def _fail(exc: OSError, path: str) -> FileOpFailed:

    c = protocol.ErrorCode
    codes = {
        errno.ENOENT: (c.FILE_NOT_FOUND, "no such file or directory"),
        errno.EACCES: (c.PERMISSION_DENIED, "permission denied"),
        errno.EPERM: (c.PERMISSION_DENIED, "operation not permitted"),
        errno.EROFS: (c.PERMISSION_DENIED, "read-only file system"),
        errno.EXDEV: (
            c.PATH_OUTSIDE_SANDBOX,
            "path resolves outside the allowed root, or through an absolute symbolic link "
            "(never followed, even to a place inside: name the real path)",
        ),
        errno.ELOOP: (c.PATH_OUTSIDE_SANDBOX, "path goes through a symlink that is not allowed"),
        errno.EISDIR: (c.IS_A_DIRECTORY, "is a directory"),
        errno.ENOTDIR: (c.NOT_A_DIRECTORY, "not a directory"),
        errno.ENOTEMPTY: (c.FILE_ERROR, "directory not empty"),
        errno.EEXIST: (c.FILE_ERROR, "already exists"),
        errno.ENOSPC: (c.FILE_ERROR, "no space left on device"),
        errno.EFBIG: (c.FILE_TOO_LARGE, "file too large for the box's limits"),
        errno.EDQUOT: (c.FILE_ERROR, "disk quota exceeded"),
        errno.ENXIO: (c.NOT_A_REGULAR_FILE, "not a regular file (a fifo or socket)"),
    }
    code, text = codes.get(exc.errno or 0, (c.FILE_ERROR, exc.strerror or str(exc)))
    return FileOpFailed(code, f"{text}: {path}")


def read_open(fd: int, offset: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``fd`` from ``offset`` (fewer at its end); closes ``fd``.
    One pread unless the kernel returns less."""
    try:
        chunks = []
        while count > 0:
            data = os.pread(fd, count, offset)
            if not data:
                break
            chunks.append(data)
            offset += len(data)
            count -= len(data)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _regular(st: os.stat_result, path: str) -> None:
    """Refuse I/O on a FIFO, socket or device node (opened O_NONBLOCK, so nothing blocked)."""
    if not stat.S_ISREG(st.st_mode):
        kind = _special(st.st_mode) if _kind(st.st_mode) == "other" else _kind(st.st_mode)
        code = protocol.ErrorCode.NOT_A_REGULAR_FILE
        raise FileOpFailed(code, f"not a regular file (a {kind}): {path}")


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device node"
    return "special file"


def _kind(mode: int) -> protocol.FileType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _describe(name: str, st: os.stat_result) -> protocol.FileEntry:
    return {
        "name": name,
        "type": _kind(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


class FileOps:
    def __init__(self, uid: int, gid: int) -> None:
        self.uid = uid
        self.gid = gid
        self._openat2: _Openat2 | None = None

    @lean.contextmanager
    def _as_user(self, root: str, path: str) -> Iterator[tuple[int, str, str]]:
        """Open the root, drop to the command user's ids, yield (root fd, rel path, path)."""
        if self._openat2 is None:
            self._openat2 = _Openat2()
        rel = os.path.relpath(path, root)
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            message = f"path is outside {root}: {path}"
            raise FileOpFailed(protocol.ErrorCode.PATH_OUTSIDE_SANDBOX, message)
        with as_user(self.uid, self.gid):
            root_fd = -1
            try:
                root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                yield root_fd, rel, path
            except OSError as exc:
                raise _fail(exc, path) from None
            finally:
                if root_fd >= 0:
                    os.close(root_fd)

    def _open(self, root_fd: int, rel: str, flags: int, mode: int = 0) -> int:
        assert self._openat2 is not None
        return self._openat2.open(root_fd, rel, flags, mode)

    def _parent(self, root_fd: int, rel: str, create: bool) -> tuple[int, str]:
        """An fd of the parent directory of ``rel`` (created beneath the root if asked)."""
        parent, name = os.path.split(rel)
        if not name or name in (".", ".."):
            raise FileOpFailed(protocol.ErrorCode.INVALID_INPUT, f"not a file name: {rel!r}")
        if create and parent:
            self._makedirs(root_fd, parent)
        return self._open(root_fd, parent or ".", os.O_PATH | os.O_DIRECTORY), name

    def _makedirs(self, root_fd: int, rel: str) -> None:
        current = ""
        for part in rel.split("/"):
            if not part or part == ".":
                continue
            parent_fd = self._open(root_fd, current or ".", os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=parent_fd)
            except FileExistsError:
                pass
            finally:
                os.close(parent_fd)
            current = os.path.join(current, part)

    def read(self, h: protocol.FileReadRequest) -> tuple[protocol.FileReadReply, bytes]:
        reply, fd, count = self.open_read(h)
        return reply, read_open(fd, h.get("offset", 0), count)

    def open_read(
        self, h: protocol.FileReadRequest, cap: int = MAX_READ
    ) -> tuple[protocol.FileReadReply, int, int]:
        """The reply to a read, an open fd of the regular file and how many bytes of it
        from ``offset`` the reply's payload is at most (the caller reads or sends them, and
        closes the fd; a file of size 0 is read to its end). At most ``cap`` bytes: what the
        agent would hold in memory, unless the kernel sends them (``sendfile``)."""
        offset = h.get("offset", 0)
        limit = min(h.get("limit", cap), cap)
        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            # O_NONBLOCK: a FIFO a command left must not block the agent on open.
            fd = self._open(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise OSError(21, "is a directory")
                _regular(st, h["path"])
            except BaseException:
                os.close(fd)
                raise
        # A size of 0 may be a file that has content all the same (/proc, /sys): read it
        # to its end, up to the limit.
        count = limit if st.st_size == 0 else max(0, min(limit, st.st_size - offset))
        reply: protocol.FileReadReply = {
            "size": st.st_size,
            "offset": offset,
            "eof": offset + count >= st.st_size,
            "dev": st.st_dev,
            "ino": st.st_ino,
        }
        return reply, fd, count

    def write(self, h: protocol.FileWriteRequest, payload: bytes) -> protocol.FileWriteReply:
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_APPEND if h.get("append") else os.O_TRUNC
        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            if h.get("parents", True):
                parent = os.path.dirname(rel)
                if parent:
                    self._makedirs(root_fd, parent)
            fd = self._open(root_fd, rel, flags | os.O_NONBLOCK, h.get("perm", 0o644) & 0o777)
            try:
                _regular(os.fstat(fd), h["path"])
                os.set_blocking(fd, True)
                view = memoryview(payload)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                st = os.fstat(fd)
            finally:
                os.close(fd)
        return {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino}

    def list(self, h: protocol.FileListRequest) -> protocol.FileListReply:
        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            fd = self._open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            entries: list[protocol.FileEntry] = []
            truncated = False
            try:
                for name in sorted(os.listdir(fd)):
                    if len(entries) >= MAX_ENTRIES:
                        truncated = True
                        break
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append(_describe(name, st))
            finally:
                os.close(fd)
        return {"entries": entries, "truncated": truncated}

    def stat(self, h: protocol.FileStatRequest) -> protocol.FileStatReply:
        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            if rel == ".":
                return {"exists": True, **_describe(".", os.stat(root_fd))}
            try:
                parent_fd, name = self._parent(root_fd, rel, create=False)
            except FileNotFoundError:
                return {"exists": False}
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                return {"exists": False}
            finally:
                os.close(parent_fd)
        return {"exists": True, **_describe(name, st)}

    def mkdir(self, h: protocol.FileMkdirRequest) -> protocol.Done:
        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            if h.get("parents", True):
                self._makedirs(root_fd, rel)
            else:
                parent_fd, name = self._parent(root_fd, rel, create=False)
                try:
                    os.mkdir(name, 0o755, dir_fd=parent_fd)
                finally:
                    os.close(parent_fd)
        return {"ok": True}

    def remove(self, h: protocol.FileRemoveRequest) -> protocol.Done:
        import shutil

        with self._as_user(h["root"], h["path"]) as (root_fd, rel, _path):
            parent_fd, name = self._parent(root_fd, rel, create=False)
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=parent_fd)
                elif h.get("recursive"):
                    shutil.rmtree(name, dir_fd=parent_fd)
                else:
                    os.rmdir(name, dir_fd=parent_fd)
            finally:
                os.close(parent_fd)
        return {"ok": True}
