"""Unpacking one OCI layer onto a root directory, safely, with Python's own tarfile.

A layer is hostile input (anyone can push an image): host code, often root, writes it into the
image cache. So every entry is placed relative to the root's fd, one component at a time with
``O_NOFOLLOW``: nothing the layer (or a lower layer) made is ever followed by host code.

* a name with a ``..`` component is refused (:class:`~corral.errors.UnsafeLayer`), a leading
  ``/`` is dropped; a name whose parent is a symlink or a file (``a -> /etc`` then
  ``a/passwd``) is refused too;
* symlinks are kept as they are, absolute ones included (``/etc/alternatives/...`` in any
  Debian image): they resolve within the box's root once the root is mounted, and the host
  never follows them;
* hard links must name an entry already in the root (this layer's or a lower one's), never a
  directory;
* no device node is ever made: those under ``dev/`` are skipped (a box's /dev is always its
  backend's, mounted over the image's; root filesystem tarballs such as mmdebstrap's carry
  ``dev/null`` and friends), one anywhere else is refused; FIFOs are made;
* setuid and setgid bits are dropped, owners are kept only when unpacking as root; xattrs (file
  capabilities) are not applied;
* whiteouts: ``.wh.NAME`` deletes NAME of the lower layers, ``.wh..wh..opq`` empties its
  directory of the lower layers' entries (after the whole layer, so entries of this layer in
  that directory stay, in whatever order the tar lists them);
* caps on the uncompressed stream, the bytes written and the number of entries stop a tarball
  bomb (:class:`~corral.errors.ImageTooLarge`);
* the compressed and uncompressed streams are hashed as they are read; the caller compares
  them with the manifest's and the config's digests once the stream is read to its end.

The caller unpacks into a private temporary directory and renames it into place when complete
(see :mod:`corral.images.store`); an error here leaves that directory to be removed whole.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from corral import errors

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Limits:
    """Caps on one layer: uncompressed bytes (stream and written), and entries."""

    max_bytes: int = 32 << 30
    max_entries: int = 2_000_000


@dataclass
class LayerDigests:
    """What the stream hashed to: ``compressed`` is the blob's digest (the manifest's),
    ``uncompressed`` the tar's (the config's ``diff_id``)."""

    compressed: str
    uncompressed: str
    size: int = 0
    entries: int = 0


class _Hashing(io.RawIOBase):
    """A read-through sha256 of a stream, with a cap on how much may be read."""

    def __init__(self, raw: IO[bytes] | gzip.GzipFile, cap: int | None = None) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._cap = cap
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        data = self._raw.read(len(buf))
        n = len(data)
        self.count += n
        if self._cap is not None and self.count > self._cap:
            raise errors.ImageTooLarge(
                f"a layer unpacks to more than {self._cap} bytes (the store's cap; a tarball bomb?)"
            )
        self._hash.update(data)
        buf[:n] = data
        return n

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


MAX_HEADER = 1 << 20
"""Bytes a PAX or GNU long-name header may hold: tarfile reads such a header into memory
whole, so a layer claiming gigabytes there would be a memory bomb before any cap counts."""


_HEADERS = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


class _SafeTarInfo(tarfile.TarInfo):
    """tarfile's member reader, refusing an oversized metadata header before reading it
    (``_proc_member`` is tarfile's hook for each header, stable since Python 3.0)."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _HEADERS and self.size > MAX_HEADER:
            raise errors.ImageTooLarge(
                f"a layer has a {self.size}-byte tar header (at most {MAX_HEADER}: a bomb?)"
            )
        return super()._proc_member(tar)  # type: ignore[misc, no-any-return]


def _decompressed(raw: _Hashing, cap: int) -> tuple[_Hashing, IO[bytes]]:
    buffered = io.BufferedReader(raw, _CHUNK)
    magic = buffered.peek(4)[:4]
    inner: IO[bytes] | gzip.GzipFile
    if magic[:2] == b"\x1f\x8b":
        inner = gzip.GzipFile(fileobj=buffered, mode="rb")
    elif magic == b"\x28\xb5\x2f\xfd":
        raise errors.ImageError(
            "a layer is compressed with zstd, which corral cannot unpack yet; "
            "use gzip layers (skopeo copy --dest-compress-format gzip)"
        )
    else:
        inner = buffered
    return _Hashing(inner, cap), buffered


def unpack_layer(blob: IO[bytes], root: Path, limits: Limits = Limits()) -> LayerDigests:
    """Apply one layer (gzip or plain tar) read from ``blob`` onto ``root``; return the
    digests its bytes hashed to. ``root`` must be private to the caller until published."""
    compressed = _Hashing(blob)
    try:
        tar_stream, buffered = _decompressed(compressed, limits.max_bytes)
        applier = _Applier(root, limits)
        try:
            with tarfile.open(fileobj=tar_stream, mode="r|", tarinfo=_SafeTarInfo) as tar:
                for member in tar:
                    applier.apply(tar, member)
            tar_stream.drain()  # the end-of-archive padding, and the gzip trailer's check
            while buffered.read(_CHUNK):
                pass
            applier.finish()
        finally:
            applier.close()
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise errors.CorruptLayer(
            f"a layer is truncated or is not a tar stream ({str(exc) or type(exc).__name__})"
        ) from None
    return LayerDigests(
        compressed=compressed.digest,
        uncompressed=tar_stream.digest,
        size=compressed.count,
        entries=applier.entries,
    )


def _components(name: str) -> list[str]:
    parts = [p for p in name.strip("/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise errors.UnsafeLayer(f"a layer entry leaves the image root: {name!r}")
    return parts


@dataclass
class _DirAttrs:
    parts: tuple[str, ...]
    mode: int
    uid: int
    gid: int
    mtime: float


@dataclass
class _Applier:
    root: Path
    limits: Limits
    entries: int = 0
    written: int = 0
    created: set[tuple[str, ...]] = field(default_factory=set)
    opaque: list[tuple[str, ...]] = field(default_factory=list)
    dirs: dict[tuple[str, ...], _DirAttrs] = field(default_factory=dict)
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)

    def __post_init__(self) -> None:
        self.root_fd = os.open(self.root, _DIR_FLAGS)

    def close(self) -> None:
        os.close(self.root_fd)

    # -- walking ---------------------------------------------------------------------------

    def _open_dir(self, parts: tuple[str, ...] | list[str], create: bool, name: str) -> int:
        """An fd of the directory ``parts`` below the root, made (0700, attributes later)
        where missing if ``create``; a symlink or a file on the way is refused."""
        fd = os.dup(self.root_fd)
        try:
            for i, part in enumerate(parts):
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o700, dir_fd=fd)
                    self.created.add(tuple(parts[: i + 1]))
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise errors.UnsafeLayer(
                            f"a layer entry goes through a symlink or a file: {name!r}"
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
                if not self.as_root and tuple(parts[: i + 1]) not in self.dirs:
                    self._keep_attrs(fd, tuple(parts[: i + 1]))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _keep_attrs(self, fd: int, parts: tuple[str, ...]) -> None:
        """An ordinary user cannot write into a lower layer's ``0555`` directory: open it
        up for this layer, and put its mode back at the end."""
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700:
            self.dirs[parts] = _DirAttrs(parts, st.st_mode, st.st_uid, st.st_gid, st.st_mtime)
            os.fchmod(fd, 0o700)

    # -- entries ---------------------------------------------------------------------------

    def apply(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise errors.ImageTooLarge(
                f"a layer has more than {self.limits.max_entries} entries (the store's cap; "
                "a tarball bomb?)"
            )
        parts = _components(member.name)
        if not parts:
            if member.isdir():
                self.dirs[()] = _DirAttrs((), member.mode, member.uid, member.gid, member.mtime)
            return
        parent, base = tuple(parts[:-1]), parts[-1]
        if member.ischr() or member.isblk():
            if parts[0] == "dev":
                return
            raise errors.UnsafeLayer(f"a layer holds a device node outside /dev: {member.name!r}")
        pfd = self._open_dir(parent, True, member.name)
        try:
            if base == OPAQUE:
                self.opaque.append(parent)
            elif base.startswith(WHITEOUT):
                target = base[len(WHITEOUT) :]
                if target in ("", ".", "..") or "/" in target:
                    raise errors.UnsafeLayer(f"a layer holds a bad whiteout: {member.name!r}")
                if (*parent, target) not in self.created:
                    _remove(pfd, target)
            else:
                self._place(tar, member, pfd, (*parent, base), base)
        finally:
            os.close(pfd)

    def _place(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        pfd: int,
        parts: tuple[str, ...],
        base: str,
    ) -> None:
        try:
            existing = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if member.isdir():
            if existing is None or not stat.S_ISDIR(existing.st_mode):
                if existing is not None:
                    _remove(pfd, base)
                os.mkdir(base, 0o700, dir_fd=pfd)
            else:
                _writable(pfd, base)
            self.dirs[parts] = _DirAttrs(parts, member.mode, member.uid, member.gid, member.mtime)
            self.created.add(parts)
            return
        if existing is not None:
            _remove(pfd, base)
        self.created.add(parts)
        if member.isreg():
            self._write(tar, member, pfd, base)
        elif member.issym():
            os.symlink(member.linkname, base, dir_fd=pfd)
            self._owner(pfd, base, member)
            os.utime(base, (member.mtime, member.mtime), dir_fd=pfd, follow_symlinks=False)
        elif member.islnk():
            self._link(member, pfd, base)
        elif member.isfifo():
            os.mkfifo(base, 0o600, dir_fd=pfd)
            self._attrs(pfd, base, member)
        else:
            raise errors.UnsafeLayer(
                f"a layer entry has a type corral does not unpack: {member.name!r}"
            )

    def _write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, pfd: int, base: str) -> None:
        if self.written + member.size > self.limits.max_bytes:
            raise errors.ImageTooLarge(
                f"a layer unpacks to more than {self.limits.max_bytes} bytes (the store's cap; "
                "a tarball bomb?)"
            )
        self.written += member.size
        src = tar.extractfile(member)
        fd = os.open(
            base,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=pfd,
        )
        with open(fd, "wb", closefd=True) as out:
            if src is not None:
                shutil.copyfileobj(src, out, _CHUNK)
            if self.as_root:
                os.fchown(out.fileno(), member.uid, member.gid)
            os.fchmod(out.fileno(), member.mode & 0o1777)
            os.utime(out.fileno(), (member.mtime, member.mtime))

    def _link(self, member: tarfile.TarInfo, pfd: int, base: str) -> None:
        target = _components(member.linkname)
        if not target:
            raise errors.UnsafeLayer(f"a hard link names the image root: {member.name!r}")
        try:
            tfd = self._open_dir(target[:-1], False, member.linkname)
        except FileNotFoundError:
            tfd = -1
        try:
            st = None if tfd < 0 else _lstat(tfd, target[-1])
            if st is None or stat.S_ISDIR(st.st_mode):
                raise errors.UnsafeLayer(
                    f"a hard link names no file of the image: {member.name!r} -> "
                    f"{member.linkname!r}"
                )
            os.link(target[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            if tfd >= 0:
                os.close(tfd)

    def _owner(self, pfd: int, base: str, member: tarfile.TarInfo) -> None:
        if self.as_root:
            os.chown(base, member.uid, member.gid, dir_fd=pfd, follow_symlinks=False)

    def _attrs(self, pfd: int, base: str, member: tarfile.TarInfo) -> None:
        self._owner(pfd, base, member)
        os.chmod(base, member.mode & 0o1777, dir_fd=pfd)  # a FIFO this layer just made
        os.utime(base, (member.mtime, member.mtime), dir_fd=pfd, follow_symlinks=False)

    # -- end of layer ----------------------------------------------------------------------

    def finish(self) -> None:
        for parent in self.opaque:
            fd = self._open_dir(parent, True, "/".join(parent))
            try:
                for name in os.listdir(fd):
                    if (*parent, name) not in self.created:
                        _remove(fd, name)
            finally:
                os.close(fd)
        for attrs in sorted(self.dirs.values(), key=lambda d: -len(d.parts)):
            fd = self._open_dir(attrs.parts, False, "/".join(attrs.parts))
            try:
                if self.as_root:
                    os.fchown(fd, attrs.uid, attrs.gid)
                os.fchmod(fd, attrs.mode & 0o1777)
                os.utime(fd, (attrs.mtime, attrs.mtime))
            finally:
                os.close(fd)


def _writable(dir_fd: int, name: str) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` (a whole tree if a directory), following no symlink."""
    st = _lstat(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)
        for child in os.listdir(fd):
            _remove(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: Path) -> None:
    """Remove a directory of the cache whole, read-only directories included (an image's
    ``0555`` directories unpacked by an ordinary user), following no symlink."""
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        _remove(parent, path.name)
    finally:
        os.close(parent)


def clone_tree(src: Path, dst: Path) -> None:
    """Make ``dst`` (absent) a copy of ``src`` that shares its files by hard links: the layer
    below an image's top layer, the start of the next one. Files of the cache are never written
    in place (a layer replaces a file by unlinking it), so sharing inodes is safe; a file at
    the hard-link limit is copied instead."""
    pending: list[tuple[Path, os.stat_result]] = []
    for here, filenames in _walk(src):
        rel = here.relative_to(src)
        target = dst / rel
        st = os.stat(here, follow_symlinks=False)
        os.mkdir(target, 0o700)
        pending.append((target, st))
        for name in filenames:
            try:
                os.link(here / name, target / name, follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.EMLINK:
                    raise
                shutil.copy2(here / name, target / name, follow_symlinks=False)
    for target, st in reversed(pending):
        if os.geteuid() == 0:
            os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
        os.chmod(target, stat.S_IMODE(st.st_mode))  # a directory this function made
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def _walk(top: Path) -> Iterator[tuple[Path, list[str]]]:
    """os.walk without following symlinks, top-down, failing loudly."""

    def fail(exc: OSError) -> None:
        raise exc

    for here, dirnames, filenames in os.walk(top, onerror=fail, followlinks=False):
        # os.walk lists a symlink to a directory among dirnames: a link, not a directory.
        links = [d for d in dirnames if os.path.islink(os.path.join(here, d))]
        dirnames[:] = [d for d in dirnames if d not in links]
        yield Path(here), filenames + links
