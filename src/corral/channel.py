"""Host end of the agent channel: requests with replies, and a stream of events.

The agent is untrusted code's neighbour, so everything it sends is validated here, against
:mod:`corral.agent.protocol`, before it reaches the rest of the library: replies must answer a
request we made and have the fields of its operation, events must have theirs. A violation,
or the agent going away, breaks the channel: every pending request fails with
:class:`SandboxBroken` and ``on_lost`` is called once. An error reply fails its request only,
with the :mod:`corral.errors` class its code maps to.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Callable
from typing import Any

from corral import errors
from corral.agent import protocol

EventHandler = Callable[[dict[str, Any], bytes], None]

_Code = protocol.ErrorCode
ERRORS: dict[str, type[errors.SandboxError]] = {
    _Code.PROTOCOL_ERROR: errors.ProtocolError,
    _Code.INVALID_INPUT: errors.SandboxError,  # with code invalid_input (error_from_reply)
    _Code.PROCESS_NOT_FOUND: errors.ProcessNotFound,
    _Code.SPAWN_FAILED: errors.SpawnFailed,
    _Code.COMMAND_NOT_FOUND: errors.CommandNotFound,
    _Code.NOT_EXECUTABLE: errors.NotExecutable,
    _Code.FILE_NOT_FOUND: errors.FileNotFound,
    _Code.PERMISSION_DENIED: errors.FilePermissionDenied,
    _Code.PATH_OUTSIDE_SANDBOX: errors.PathOutsideSandbox,
    _Code.FILE_TOO_LARGE: errors.FileTooLarge,
    _Code.IS_A_DIRECTORY: errors.IsADirectory,
    _Code.NOT_A_DIRECTORY: errors.NotADirectory,
    _Code.FILE_ERROR: errors.FileOpError,
    _Code.NOT_A_REGULAR_FILE: errors.NotARegularFile,
    _Code.AGENT_ERROR: errors.BackendError,
}
"""Every agent error code -> the error the caller gets (a test holds it complete)."""


def error_from_reply(header: dict[str, Any]) -> errors.SandboxError | None:
    """The error an error reply stands for, or None for a successful reply."""
    found = protocol.reply_error(header)
    if found is None:
        return None
    code, message = found
    if code == _Code.INVALID_INPUT:
        return errors.SandboxError(message, code=errors.ErrorCode.INVALID_INPUT)
    return ERRORS[code](message)


class Channel:
    def __init__(self, sock: socket.socket, on_event: EventHandler) -> None:
        self._sock = sock
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self._ops: dict[int, str] = {}  # request id -> its operation, to check the reply
        self._hooks: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self.lost: asyncio.Event = asyncio.Event()
        self.lost_reason = ""
        self.on_lost: Callable[[str], None] | None = None

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=1 << 22)
        self._task = asyncio.create_task(self._read_loop(reader), name="corral-channel")

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._ready)
        except TimeoutError:
            raise errors.BackendError(
                f"the guest agent did not become ready within {timeout:g} s"
            ) from None

    async def request(
        self,
        op: str,
        payload: bytes = b"",
        *,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request and wait for its reply.

        ``on_reply`` runs synchronously when a successful reply is read, before any later
        frame is dispatched: a spawn registers its process there, so none of the process's
        output events can arrive before the process is known.
        """
        if self.lost.is_set() or self._writer is None:
            raise errors.SandboxBroken(f"the sandbox is gone: {self.lost_reason or 'not started'}")
        req_id = next(self._ids)
        request = {"op": op, "id": req_id, **fields}
        try:
            protocol.check_request(request)  # a caller's mistake, named before it is sent
        except protocol.FrameError as exc:
            raise errors.SandboxError(str(exc), code=errors.ErrorCode.INVALID_INPUT) from None
        try:
            frame = protocol.encode(request, payload)
        except protocol.FrameError as exc:
            raise errors.RequestTooLarge(
                f"{op} request too large to send to the box: {exc}"
            ) from None
        fut: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[req_id] = fut
        self._ops[req_id] = op
        if on_reply is not None:
            self._hooks[req_id] = on_reply
        try:
            self._writer.write(frame)
            await self._writer.drain()
            header, data = await fut
        except (ConnectionError, OSError) as exc:
            self._lose(f"channel write failed: {exc}")
            raise errors.SandboxBroken(f"the sandbox is gone: {self.lost_reason}") from exc
        finally:
            self._pending.pop(req_id, None)
            self._ops.pop(req_id, None)
            self._hooks.pop(req_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the channel: retrieved, so it is not logged
        error = error_from_reply(header)
        if error is not None:
            raise error
        return header, data

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = protocol.FrameDecoder()
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    self._lose("the guest agent exited")
                    return
                for header, payload in decoder.feed(data):
                    self._dispatch(header, payload)
        except protocol.FrameError as exc:
            self._lose(f"protocol violation by the guest agent: {exc}")
        except (ConnectionError, OSError) as exc:
            self._lose(f"channel read failed: {exc}")

    def _dispatch(self, header: dict[str, Any], payload: bytes) -> None:
        if "re" in header:
            req_id = header["re"]
            fut = self._pending.get(req_id) if type(req_id) is int else None
            if fut is None:
                raise protocol.FrameError(f"reply to an unknown request {req_id!r}")
            if "error" not in header:
                protocol.check_reply(self._ops[req_id], header)
                hook = self._hooks.pop(req_id, None)
                if hook is not None:
                    hook(header)
            if not fut.done():
                fut.set_result((header, payload))
            return
        ev = protocol.check_event(header)
        if ev == "ready":
            if not self._ready.done():
                self._ready.set_result(header)
            return
        self._on_event(header, payload)

    def abandon(self, reason: str) -> None:
        """Give the agent up (it stopped answering): pending and later requests fail with
        ``reason``, as when it exits."""
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_reason = reason
        self.lost.set()
        broken = errors.SandboxBroken(f"the sandbox is gone: {reason}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(broken)
        if not self._ready.done():
            self._ready.set_exception(errors.BackendError(f"the guest agent failed: {reason}"))
            self._ready.exception()  # retrieved here, so an unawaited failure is not logged
        if self.on_lost is not None:
            self.on_lost(reason)

    async def close(self) -> None:
        self._lose("closed")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self._writer.wait_closed()
