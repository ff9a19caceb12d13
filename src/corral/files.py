"""File operations on a box, confined to what the policy grants.

Two checks, at two depths:

* here, lexically (pure, :func:`resolve`): a relative path is taken from the workspace; an
  absolute one must lie under a root the policy grants (the workspace, ``/tmp``, the
  ``allow_write`` paths and the mounts); ``..`` that climbs out and masked (``deny_read``)
  paths are refused before anything is sent;
* in the agent, by the kernel: the path is opened with ``openat2(RESOLVE_BENEATH)`` from the
  root's fd, so a symlink that points out is refused however and whenever it was made.

The bytes of a large read or write in the workspace (over :data:`HOST_IO_OVER`) do not cross
the agent's channel: the agent opens the file as the command user and names its inode, and
the host reads or appends the rest through an fd of that same inode, opened beneath the
workspace's host directory without following any link
(:mod:`corral.backends.host.hostfiles`). When that fd cannot be had (a link, a path swapped
meanwhile, a backend whose box sees other inode numbers) the agent carries the bytes.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corral import errors
from corral.agent import protocol
from corral.agent.files import _fail
from corral.backends.host import hostfiles
from corral.backends.host.threads import blocking
from corral.channel import ERRORS
from corral.models import FileInfo
from corral.output import text_bytes
from corral.policy import Policy
from corral.processes import Request

KERNEL_VIEWS = ("/proc", "/sys", "/dev")
"""Not read through the files API outside the writable roots (see :func:`resolve`)."""
CHUNK = 8 << 20
"""A read asks for this much at a time (the agent sends it by sendfile): each frame then costs
the event loop a few milliseconds of copying, never tens."""
WRITE_CHUNK = 1 << 20
"""Writes go in 1 MiB frames: each step of the event loop then copies a few MiB at most (an
8 MiB frame was sliced, framed and buffered in one step, over 20 ms of the loop)."""
DEFAULT_MAX_READ = 64 << 20
JOIN_ON_LOOP = 4 << 20
"""A read's pieces are joined in a thread past this."""
HOST_IO_OVER = 1 << 20
"""A read or write in the workspace larger than this moves its bytes through a host fd; the
agent's first frame (this much) answers smaller ones in one round trip."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """A box path checked against the policy's granted roots."""

    path: str
    """Absolute, normalised path inside the box."""
    root: str
    """The granted root it lies under; the agent opens beneath it."""


def granted_roots(policy: Policy, home: str | None = None) -> tuple[str, ...]:
    home = home or os.path.expanduser("~")
    roots = [policy.workdir, "/tmp"]
    roots.extend(_expand(raw, home) for raw in policy.filesystem.allow_write)
    roots.extend(m.guest for m in policy.filesystem.mounts)
    return tuple(posixpath.normpath(r) for r in roots)


def _expand(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    return path


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def resolve(
    path: str, policy: Policy, home: str | None = None, *, reading: bool = False
) -> Resolved:
    """Map a user path to (absolute box path, granted root) or raise PathOutsideSandbox.
    ``reading``: an absolute path outside the writable roots resolves beneath ``/`` (the
    box's own view, read as the command user: what a command can ``cat``, the files API can
    read); writing stays confined to the workspace, /tmp, ``allow_write`` and mounts."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise errors.SandboxError(
            f"invalid path {path!r}: give a non-empty path without NUL bytes",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    home = home or os.path.expanduser("~")
    raw = path if path.startswith("/") else posixpath.join(policy.workdir, path)
    norm = posixpath.normpath(raw)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    if not path.startswith("/") and not _under(norm, policy.workdir):
        raise errors.PathOutsideSandbox(
            f"path {path!r} climbs out of the workspace {policy.workdir}; "
            "use a path inside the workspace"
        )
    for denied in policy.filesystem.deny_read:
        d = posixpath.normpath(_expand(denied, home))
        if not denied.startswith(("/", "~")):
            d = posixpath.normpath(posixpath.join(policy.workdir, denied))
        if _under(norm, d):
            raise errors.PathOutsideSandbox(f"path {path!r} is masked by the policy (deny_read)")
    roots = sorted(granted_roots(policy, home), key=len, reverse=True)
    for root in roots:
        if _under(norm, root):
            return Resolved(norm, root)
    if reading:
        if any(_under(norm, k) for k in KERNEL_VIEWS):
            # Seen by the guest agent, /proc/self would be the agent itself (its memory,
            # its environment), not a command: these are read with a command.
            raise errors.PathOutsideSandbox(
                f"path {path!r} is a kernel interface; read it with a command (cat)"
            )
        return Resolved(norm, "/")
    raise errors.PathOutsideSandbox(
        f"path {path!r} is outside what the policy grants to file operations "
        f"({', '.join(sorted(set(roots)))})"
    )


def _join(parts: list[bytes | memoryview]) -> bytes:
    """``b"".join(parts)`` for a thread: CPython's join lets the GIL go only when every part
    is ``bytes`` (views could change under it), so views are made bytes first, a piece at a
    time (the GIL passes between them); held by a join of views, 60 MiB kept the event loop
    waiting 40 ms."""
    for i, part in enumerate(parts):
        if type(part) is not bytes:
            parts[i] = bytes(part)
    return b"".join(parts)


class Files:
    """``sandbox.files``: read, write, list, stat, mkdir, remove inside the box."""

    def __init__(
        self, policy: Policy, request: Request, host_area: Callable[[], str | None] | None = None
    ) -> None:
        self._policy = policy
        self._send = request
        self._host_area = host_area
        """The host directory of the workspace, when the host may move a file's bytes."""
        self._host_ok = True
        self.on_denied: Callable[[str, str, str], None] | None = None
        """Called with (operation, path, reason) for every refused operation (audit log)."""

    def use_policy(self, policy: Policy) -> None:
        """The policy with its paths resolved, once the sandbox knows its workspace."""
        self._policy = policy

    def _resolve(self, path: str, *, reading: bool = False) -> Resolved:
        try:
            return resolve(path, self._policy, reading=reading)
        except errors.PathOutsideSandbox as exc:
            self._denied("resolve", path, exc.message)
            raise

    def _host(self, r: Resolved) -> tuple[str, str] | None:
        """(host directory, relative path) when the host may move ``r``'s bytes."""
        if self._host_area is None or not self._host_ok or r.root != self._policy.workdir:
            return None
        area = self._host_area()
        return None if area is None else (area, posixpath.relpath(r.path, r.root))

    def _host_failed(self, path: str, exc: OSError) -> errors.SandboxError:
        failed = _fail(exc, path)
        return ERRORS[failed.code](f"{path}: {failed.message}")

    async def _request(self, op: str, payload: bytes | memoryview = b"", **fields: Any) -> Any:
        """One agent call; refusals by the kernel (symlinks out, read-only) are reported.
        ``pieces=True`` (a read): the payload may come as :class:`protocol.Pieces`."""
        try:
            return await self._send(op, payload, **fields)
        except (errors.PathOutsideSandbox, errors.FilePermissionDenied) as exc:
            self._denied(op, str(fields.get("path", "")), exc.message)
            raise

    def _denied(self, op: str, path: str, reason: str) -> None:
        if self.on_denied is not None:
            self.on_denied(op, path, reason)

    async def read(
        self, path: str, *, max_bytes: int | None = None, offset: int = 0, length: int | None = None
    ) -> bytes:
        """Whole file contents. Larger than ``max_bytes`` (default 64 MiB) -> FileTooLarge.
        With ``length``: at most ``length`` bytes from ``offset`` (fewer at the end of the
        file), never FileTooLarge."""
        r = self._resolve(path, reading=True)
        if offset < 0 or (length is not None and length < 0):
            raise errors.SandboxError(
                f"offset {offset} and length {length} must be >= 0",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        if length is not None or offset:
            return await self._read_range(r, offset, length)
        limit = DEFAULT_MAX_READ if max_bytes is None else max_bytes
        host = self._host(r)
        parts: list[bytes | memoryview] = []
        offset = 0
        while True:
            want = min(CHUNK if host is None else HOST_IO_OVER, limit + 1 - offset)
            reply, data = await self._request(
                "file_read", path=r.path, root=r.root, offset=offset, limit=want, pieces=True
            )
            if isinstance(data, protocol.Pieces):
                parts.extend(data)
                got = sum(map(len, data))
            else:
                parts.append(data)
                got = len(data)
            offset += got
            if offset > limit:
                raise self._too_large(path, reply.get("size"), limit)
            if reply.get("eof") or not got:
                # One copy of the whole file, from the pieces it came in (1 MiB or less each);
                # a large one off the event loop (tens of MiB take tens of milliseconds).
                if len(parts) == 1 and isinstance(parts[0], bytes):
                    return parts[0]
                if offset > JOIN_ON_LOOP:
                    return await blocking(_join, parts)
                return b"".join(parts)
            if host is not None and "ino" in reply:
                whole = await self._host_read(host, (reply["dev"], reply["ino"]), limit)
                if whole is not None:
                    if len(whole) > limit:
                        raise self._too_large(path, reply.get("size"), limit)
                    return whole
            host = None  # the agent carries the rest

    async def _host_read(
        self, host: tuple[str, str], inode: hostfiles.Inode, limit: int
    ) -> bytes | None:
        try:
            whole = await blocking(hostfiles.read_same, *host, inode, limit)
        except OSError:
            whole = None
        if whole is None:
            self._host_ok = False  # not the agent's file: this box goes through the agent
        return whole

    @staticmethod
    def _too_large(path: str, size: object, limit: int) -> errors.FileTooLarge:
        return errors.FileTooLarge(
            f"{path} is {size} bytes, more than the {limit} allowed; pass max_bytes= to read more"
        )

    async def _read_range(self, r: Resolved, offset: int, length: int | None) -> bytes:
        chunks: list[bytes] = []
        end = None if length is None else offset + length
        while end is None or offset < end:
            want = CHUNK if end is None else min(CHUNK, end - offset)
            reply, data = await self._request(
                "file_read", path=r.path, root=r.root, offset=offset, limit=want
            )
            chunks.append(data)
            offset += len(data)
            if reply.get("eof") or not data:
                break
        if sum(map(len, chunks)) > JOIN_ON_LOOP:  # tens of MiB: off the event loop
            return await blocking(_join, chunks)
        return b"".join(chunks)

    async def read_text(self, path: str, *, max_bytes: int | None = None) -> str:
        return (await self.read(path, max_bytes=max_bytes)).decode(errors="replace")

    async def write(
        self, path: str, data: bytes | str, *, append: bool = False, parents: bool = True
    ) -> int:
        """Write (or append) a file, creating parent directories; returns the new size."""
        r = self._resolve(path)
        raw = text_bytes(data)
        host = self._host(r) if len(raw) > HOST_IO_OVER else None
        view = memoryview(raw)  # frames are sent from it, not from copies
        size = 0
        first = True
        for start in range(0, max(len(raw), 1), WRITE_CHUNK):
            reply, _ = await self._request(
                "file_write",
                view[start : start + WRITE_CHUNK],
                path=r.path,
                root=r.root,
                append=append or not first,
                parents=parents,
            )
            size = int(reply.get("size", 0))
            first = False
            if host is not None and "ino" in reply:
                rest = view[start + WRITE_CHUNK :]
                try:
                    grown = await blocking(
                        hostfiles.append_same, *host, (reply["dev"], reply["ino"]), rest
                    )
                except OSError as exc:
                    raise self._host_failed(r.path, exc) from None
                if grown is not None:
                    return grown
                self._host_ok = False
            host = None
        return size

    async def list(self, path: str = ".") -> list[FileInfo]:
        r = self._resolve(path, reading=True)
        reply, _ = await self._request("file_list", path=r.path, root=r.root)
        return [
            FileInfo(
                name=str(e["name"]),
                path=posixpath.join(r.path, str(e["name"])),
                type=e["type"],
                size=int(e["size"]),
                mode=int(e["mode"]),
                mtime=float(e["mtime"]),
            )
            for e in reply.get("entries", [])
        ]

    async def stat(self, path: str) -> FileInfo | None:
        r = self._resolve(path, reading=True)
        reply, _ = await self._request("file_stat", path=r.path, root=r.root)
        if not reply.get("exists"):
            return None
        return FileInfo(
            name=posixpath.basename(r.path) or "/",
            path=r.path,
            type=reply["type"],
            size=int(reply["size"]),
            mode=int(reply["mode"]),
            mtime=float(reply["mtime"]),
        )

    async def exists(self, path: str) -> bool:
        return await self.stat(path) is not None

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        r = self._resolve(path)
        await self._request("file_mkdir", path=r.path, root=r.root, parents=parents)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        r = self._resolve(path)
        if r.path == r.root:
            raise errors.SandboxError(
                f"refusing to remove the root {r.root} itself", code=errors.ErrorCode.INVALID_INPUT
            )
        await self._request("file_remove", path=r.path, root=r.root, recursive=recursive)
