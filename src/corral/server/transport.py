"""HTTP serving shared by ``corral mcp --http`` and ``corral serve``: uvicorn's h11 protocol
with a header timeout and a connection cap, unix sockets that serve their owner only
(``SO_PEERCRED``), and bearer tokens kept in 0600 files of the user's runtime directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from corral import errors

__all__ = [
    "HEADER_TIMEOUT",
    "LOOPBACK",
    "MAX_CONNECTIONS",
    "GuardedH11Protocol",
    "bind_unix",
    "http_server_config",
    "kept_token",
    "new_token",
    "peer_uid",
    "runtime_dir",
    "write_token_file",
]

logger = logging.getLogger("corral.server")

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Host names that mean this machine only (any local user can still connect to them)."""

# ---- connection limits -----------------------------------------------------------------------
HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a complete request head (first or next request)."""
MAX_CONNECTIONS = 256
"""Open connections; past it the oldest one with no request in flight is closed."""
MAX_HEAD_BYTES = 64 << 10


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection cap that evicts.

    uvicorn's ``timeout_keep_alive`` starts only after a first response, and
    ``limit_concurrency`` answers 503 to the *new* client once idle sockets fill it, so a
    thousand silent connections would starve a real one. Here a connection that has not
    sent a whole request head within ``HEADER_TIMEOUT`` is closed, and a new connection past
    ``MAX_CONNECTIONS`` evicts the oldest idle connection rather than being turned away.
    """

    header_timeout = HEADER_TIMEOUT
    max_connections = MAX_CONNECTIONS
    _order = 0
    _warned = False
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP; one
            # bound with proto 0 (ours, or one passed in) left every response's second
            # write waiting ~40 ms for the client's delayed ACK (Nagle).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        GuardedH11Protocol._order += 1
        self._made = GuardedH11Protocol._order
        peer = peer_uid(transport.get_extra_info("socket"))
        if peer is not None and peer != os.getuid():
            # A unix socket serves its owner only (its 0600 mode says so too).
            logger.warning("refused a unix-socket connection from uid %d", peer)
            transport.abort()
            return
        self._arm_head_timer()
        if len(self.connections) > self.max_connections:
            idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c._idle()]
            victim = min(idle, key=lambda c: c._made) if idle else self
            if not GuardedH11Protocol._warned:  # once: an attack must not flood the log
                GuardedH11Protocol._warned = True
                logger.warning(
                    "more than %d HTTP connections: closing idle ones", self.max_connections
                )
            victim._close()

    def _arm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    read_whole: Callable[[str], bool] | None = None
    """Whether a request to a path has its body read whole (small and capped): a connection
    still sending such a body counts as idle, or clients trickling bodies would hold every
    connection slot."""

    def _idle(self) -> bool:
        """No request in flight: waiting for (the rest of) a request head; or still sending
        a body that is read whole, before any answer."""
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if not in_flight and self.conn.their_state is h11.IDLE:
            return True
        cycle = self.cycle
        return (
            self.read_whole is not None
            and self.conn.their_state is h11.SEND_BODY
            and cycle is not None
            and not cycle.response_started
            and self.read_whole(str(getattr(self, "scope", {}).get("path", "")))
        )

    body_grace = 12.0
    """Once a head has come with a body that is read whole, the connection is given this
    long more before the head timer closes it: the body's own timeout (``BODY_TIMEOUT``,
    10 s from the head) answers first, with the documented 408."""
    _grace_given = False

    def _head_timeout(self) -> None:
        if not self._idle():
            return
        if self.conn.their_state is h11.SEND_BODY and not self._grace_given:
            self._grace_given = True
            self._head_timer = self.loop.call_later(self.body_grace, self._head_timeout)
            return
        self._close()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._grace_given = False
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)


def peer_uid(sock: Any) -> int | None:
    """The uid at the other end of a unix socket (``SO_PEERCRED``); None for TCP."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    uid: int = struct.unpack("3i", creds)[1]
    return uid


def bind_unix(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, mode 0600 from its first moment (a stale socket
    of ours is replaced; a live one, where a server still answers, or anything else at
    ``path`` is an error)."""
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
            raise errors.PolicyError(f"{path} exists and is not a socket of this user")
        if _answers(path):
            # Replacing it would leave that server, and every box it holds, unreachable.
            raise errors.SandboxError(
                f"a server already listens on {path}: stop it first, or give another --socket",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise errors.SandboxError(
            f"cannot listen on {path}: {exc.strerror}", code=errors.ErrorCode.INVALID_INPUT
        ) from None
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False  # ECONNREFUSED: nobody listens; it is stale
    finally:
        probe.close()
    return True


def http_server_config(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    header_timeout: float = HEADER_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    ws: Literal["none", "websockets-sansio"] = "none",
    read_whole: Callable[[str], bool] | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration ``serve_http`` uses: bounded heads, idle time and sockets."""
    protocol = type(
        "CorralH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_connections": max_connections,
            "read_whole": staticmethod(read_whole) if read_whole else None,
        },
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        ws=ws,
        log_level="warning",
        timeout_keep_alive=5,
        # Requests (not sockets) past this get a 503; sockets are capped by eviction above.
        limit_concurrency=max_connections * 2,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=5,
    )


# ---- the token file --------------------------------------------------------------------------
def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/corral`` (or ``/run/user/UID/corral``, else a 0700 temp dir)."""
    uid = os.getuid()
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    root = Path(base) if os.path.isdir(base) else Path(tempfile.gettempdir())
    where = root / ("corral" if root == Path(base) else f"corral-{uid}")
    with contextlib.suppress(FileExistsError):
        where.mkdir(mode=0o700)
    info = os.lstat(where)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise errors.PolicyError(f"{where} is not a private directory of uid {uid}")
    return where


def write_token_file(token: str, name: str) -> Path:
    """Write ``token`` to a 0600 file of the current user (never through a symlink)."""
    path = runtime_dir() / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token + "\n")
    return path


def new_token() -> str:
    return secrets.token_urlsafe(32)


def kept_token(name: str) -> str | None:
    """The token in this user's 0600 token file ``name`` from an earlier run, if it is one
    (a regular file of ours that nobody else may read, holding a token of ours' shape):
    a server restarted at the same address keeps its token, so its clients and the
    dashboard's open tab go on working. None otherwise."""
    try:
        fd = os.open(runtime_dir() / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        text = f.read(256).decode("ascii", "replace").strip()
    if len(text) < 32 or not all(c.isalnum() or c in "-_" for c in text):
        return None
    return text
