"""Serving shared PTY sessions to other processes, so a human can attach to them.

A session is private to its process until it is shared (``Sandbox.shell(shared=True)`` or
``Sandbox.share(session)``; ``corral shell`` and the MCP server share theirs). The process
then serves its shared sessions on one unix socket, ``<dir>/<owner-pid>.sock``, where
``<dir>`` is ``$CORRAL_SESSIONS_DIR``, else ``$XDG_RUNTIME_DIR/corral``, else
``/run/corral/sessions`` for root and ``/tmp/corral-<uid>/sessions`` for others. The
directory is 0700 and the socket 0600, and every connection's peer uid is checked
(``SO_PEERCRED``): only the same user may attach, because an attached terminal can type
into the box.

The server starts with the first session this process shares (in the running event loop)
and stops when the last shared one closes. Messages use the guest agent's frame format (JSON
header + raw payload), so terminal bytes never go through JSON:

* ``{"op": "list"}`` -> ``{"sessions": [...]}``
* ``{"op": "attach", "session_id", "cols", "rows"}`` -> ``{"ok": true, ...}`` with the recent
  screen tail as payload, then ``{"ev": "out"}`` frames and finally ``{"ev": "exit"}``; the
  client sends ``{"op": "input"}`` (payload), ``{"op": "resize", "cols", "rows"}`` and
  ``{"op": "detach"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from corral import errors
from corral.agent import protocol
from corral.sessions.pty import PtySession

__all__ = ["list_sessions", "locate", "offer", "socket_dir"]

# A terminal that stops reading must not make the owner buffer output without bound.
CLIENT_BUFFER_LIMIT = 4 << 20
CONNECT_TIMEOUT = 2.0
Frames = AsyncGenerator[tuple[dict[str, Any], bytes], None]


def socket_dir() -> Path:
    override = os.environ.get("CORRAL_SESSIONS_DIR")
    if override:
        return Path(override)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "corral"
    if os.getuid() == 0:
        return Path("/run/corral/sessions")
    return Path(tempfile.gettempdir()) / f"corral-{os.getuid()}" / "sessions"


def _private_dir() -> Path:
    """Create the socket directory 0700 and refuse one someone else could use."""
    path = socket_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise errors.SessionError(
            f"{path} is not a directory owned by uid {os.getuid()}; remove it or set "
            "CORRAL_SESSIONS_DIR",
            code=errors.ErrorCode.PERMISSION_DENIED,
        )
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class AttachServer:
    """The per-process session server; see the module docstring."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.path = _private_dir() / f"{os.getpid()}.sock"
        self.sessions: dict[str, PtySession] = {}
        self._server: asyncio.Server | None = None
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a leftover of a dead process with our pid
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._clients.values():
                writer.close()
            await self._server.wait_closed()
            if self._clients:
                await asyncio.gather(*self._clients, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients[task] = writer
        try:
            sock = writer.get_extra_info("socket")
            if sock is None or _peer_uid(sock) != os.getuid():
                return
            frames = _frames(reader)
            try:
                header, _ = await anext(frames, ({}, b""))
                if header.get("op") == "list":
                    live = [describe(s) for s in self.sessions.values() if not s.closed]
                    writer.write(protocol.encode({"sessions": live}))
                elif header.get("op") == "attach":
                    await self._attach(header, frames, writer)
            finally:
                await frames.aclose()
        except (ConnectionError, protocol.FrameError):
            pass  # a client that hangs up or talks nonsense just loses its connection
        finally:
            del self._clients[task]
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _attach(
        self, header: dict[str, Any], frames: Frames, writer: asyncio.StreamWriter
    ) -> None:
        session = self.sessions.get(str(header.get("session_id")))
        if session is None or session.closed:
            message = f"no running session {header.get('session_id')!r} in process {os.getpid()}"
            writer.write(
                protocol.encode({"error": {"code": "session_not_found", "message": message}})
            )
            return
        before = (session.cols, session.rows)
        await _resize(session, header)
        # Replay and watch in one step (no await between), so no output falls in a gap.
        writer.write(protocol.encode({"ok": True, **describe(session)}, session.recent_output()))

        def forward(data: bytes | None) -> None:
            if writer.is_closing():
                return
            if data is None:
                writer.write(protocol.encode({"ev": "exit", "exit_code": session.exit_code}))
                writer.close()  # ends the read loop below
            elif writer.transport.get_write_buffer_size() > CLIENT_BUFFER_LIMIT:
                writer.close()
            else:
                writer.write(protocol.encode({"ev": "out"}, data))

        unwatch = session.watch(forward)
        try:
            async for request, payload in frames:
                op = request.get("op")
                if op == "input" and payload:
                    await session.write(payload)
                elif op == "resize":
                    await _resize(session, request)
                elif op == "detach":
                    break
        except errors.SandboxError:
            pass  # the session ended while we were forwarding input
        finally:
            # Give the agent its own window size back when the last human leaves (before
            # unwatch, so whoever waits for the detach sees the size already restored).
            last = session.attached == 1
            if last and not session.closed and before != (session.cols, session.rows):
                with contextlib.suppress(errors.SandboxError):
                    await session.resize(*before)
            unwatch()


async def _resize(session: PtySession, message: dict[str, Any]) -> None:
    cols, rows = message.get("cols"), message.get("rows")
    if (
        isinstance(cols, int)
        and isinstance(rows, int)
        and (cols, rows) != (session.cols, session.rows)
    ):
        with contextlib.suppress(errors.SandboxError):
            await session.resize(cols, rows)


async def _frames(reader: asyncio.StreamReader) -> Frames:
    decoder = protocol.FrameDecoder()
    while data := await reader.read(65536):
        for frame in decoder.feed(data):
            yield frame


def describe(session: PtySession) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "shell": session.shell,
        "owner_pid": os.getpid(),
        "created_at": session.created_at,
        "attached": session.attached,
        "cols": session.cols,
        "rows": session.rows,
    }


# ---- the per-process server, started on demand ----------------------------------------------
_server: AttachServer | None = None
_stopping: set[asyncio.Task[None]] = set()


async def offer(session: PtySession) -> Path:
    """Make ``session`` attachable until it closes, starting this process's server if
    needed; returns the socket it is served on. Offering a shared session again is a no-op."""
    global _server
    if session.closed:
        raise errors.SessionNotFound(f"session {session.session_id} is closed")
    if _server is None or _server.loop is not asyncio.get_running_loop():
        server = AttachServer()
        await server.start()
        _server = server
    if session.session_id not in _server.sessions:
        _server.sessions[session.session_id] = session

        async def unshare() -> None:
            withdraw(session)
            await settle()

        session.on_close(unshare)
    return _server.path


def withdraw(session: PtySession) -> None:
    """Stop offering ``session``; the server stops with its last session (see settle)."""
    global _server
    server = _server
    if server is None or server.sessions.pop(session.session_id, None) is None:
        return
    if not server.sessions and server.loop is asyncio.get_running_loop():
        _server = None
        task = server.loop.create_task(server.stop())
        _stopping.add(task)
        task.add_done_callback(_stopping.discard)


async def settle() -> None:
    """Wait until a server being stopped has closed its socket and connections."""
    loop = asyncio.get_running_loop()
    pending = [t for t in _stopping if t.get_loop() is loop]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def _request(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(str(path))
        sock.sendall(protocol.encode(header))
        decoder = protocol.FrameDecoder()
        while chunk := sock.recv(65536):
            for reply, _ in decoder.feed(chunk):
                return reply
    raise ConnectionError("the session server hung up")


def _owner_alive(path: Path) -> bool:
    try:
        os.kill(int(path.stem), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def list_sessions() -> list[tuple[Path, dict[str, Any]]]:
    """Every attachable session of this user: (server socket, description)."""
    directory = socket_dir()
    found: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(directory.glob("*.sock")) if directory.is_dir() else []:
        try:
            reply = _request(path, {"op": "list"})
        except OSError:
            if not _owner_alive(path):
                with contextlib.suppress(OSError):
                    path.unlink()  # the owner died without cleaning up
            continue
        found.extend((path, s) for s in reply.get("sessions", []) if isinstance(s, dict))
    return found


def locate(session_id: str) -> tuple[Path, dict[str, Any]]:
    """The server of a session, given its id or a unique prefix of it."""
    matches = [
        (p, s) for p, s in list_sessions() if str(s.get("session_id", "")).startswith(session_id)
    ]
    exact = [(p, s) for p, s in matches if s.get("session_id") == session_id]
    if len(exact) == 1 or len(matches) == 1:
        return (exact or matches)[0]
    if matches:
        raise errors.SessionError(
            f"{session_id!r} matches {len(matches)} sessions; give more of the id",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    raise errors.SessionNotFound(
        f"no attachable session {session_id!r}; `corral sessions` lists them"
    )
