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
Payload = bytes | protocol.Pieces
"""A reply's payload: a large one (a file read) as the pieces it arrived in."""

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
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], Payload]]] = {}
        self._ops: dict[int, str] = {}  # request id -> its operation, to check the reply
        self._hooks: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._abandoned: dict[int, str] = {}
        """Requests whose caller was cancelled before the reply came -> their operation:
        the reply still comes, and is dropped (checked) when it does."""
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._wire: _Wire | None = None
        self.lost: asyncio.Event = asyncio.Event()
        self.lost_reason = ""
        self.on_lost: Callable[[str], None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        _, self._wire = await loop.create_unix_connection(lambda: _Wire(self), sock=self._sock)

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
        payload: bytes | memoryview = b"",
        *,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> tuple[dict[str, Any], bytes]:
        """:meth:`request_pieces`, its reply's payload joined."""
        header, data = await self.request_pieces(op, payload, on_reply=on_reply, **fields)
        return header, data if isinstance(data, bytes) else b"".join(data)

    async def request_pieces(
        self,
        op: str,
        payload: bytes | memoryview = b"",
        *,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> tuple[dict[str, Any], Payload]:
        """Send one request and wait for its reply (a large payload as its pieces: the
        files API joins the pieces of several replies once).

        ``on_reply`` runs synchronously when a successful reply is read, before any later
        frame is dispatched: a spawn registers its process there, so none of the process's
        output events can arrive before the process is known.
        """
        if self.lost.is_set() or self._wire is None:
            raise errors.SandboxBroken(f"the sandbox is gone: {self.lost_reason or 'not started'}")
        req_id = next(self._ids)
        request = {"op": op, "id": req_id, **fields}
        try:
            protocol.check_request(request)  # a caller's mistake, named before it is sent
        except protocol.FrameError as exc:
            raise errors.SandboxError(str(exc), code=errors.ErrorCode.INVALID_INPUT) from None
        try:
            head = protocol.encode_head(request, len(payload))
        except protocol.FrameError as exc:
            raise errors.RequestTooLarge(
                f"{op} request too large to send to the box: {exc}"
            ) from None
        fut: asyncio.Future[tuple[dict[str, Any], Payload]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[req_id] = fut
        self._ops[req_id] = op
        if on_reply is not None:
            self._hooks[req_id] = on_reply
        try:
            await self._wire.write(head, payload)
            header, data = await fut
        except (ConnectionError, OSError) as exc:
            self._lose(f"channel write failed: {exc}")
            raise errors.SandboxBroken(f"the sandbox is gone: {self.lost_reason}") from exc
        finally:
            self._pending.pop(req_id, None)
            operation = self._ops.pop(req_id, None)
            self._hooks.pop(req_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the channel: retrieved, so it is not logged
            elif operation is not None and not self.lost.is_set():
                self._abandoned[req_id] = operation  # its reply is on its way
        error = error_from_reply(header)
        if error is not None:
            raise error
        return header, data

    def _dispatch(self, header: dict[str, Any], payload: bytes | protocol.Pieces) -> None:
        if "re" in header:
            req_id = header["re"]
            fut = self._pending.get(req_id) if type(req_id) is int else None
            if fut is None:
                gone = self._abandoned.pop(req_id, None) if type(req_id) is int else None
                if gone is None:
                    raise protocol.FrameError(f"reply to an unknown request {req_id!r}")
                if "error" not in header:
                    protocol.check_reply(gone, header)
                return  # its caller was cancelled: nobody waits for it
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
        if isinstance(payload, protocol.Pieces):  # events are small (64 KiB of output)
            payload = b"".join(payload)
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
        if self._wire is not None:
            await self._wire.close()


class _Wire(asyncio.Protocol):
    """The channel socket's transport callbacks: bytes in go straight to the frame decoder
    (no stream buffer to copy them through: a file read of many MiB is copied once, into its
    payload), frames out wait while the kernel's buffer is full."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._decoder = protocol.FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for header, payload in self._decoder.feed_pieces(data):
                self._channel._dispatch(header, payload)
        except protocol.FrameError as exc:
            self._channel._lose(f"protocol violation by the guest agent: {exc}")
            if self._transport is not None:
                self._transport.close()

    def eof_received(self) -> bool:
        self._channel._lose("the guest agent exited")
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._channel._lose(f"channel read failed: {exc}" if exc else "the guest agent exited")
        self._wake(exc or ConnectionResetError("the channel is closed"))
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake(None)

    def _wake(self, exc: BaseException | None) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: a writer that gave up is not logged

    async def write(self, head: bytes, payload: bytes | memoryview = b"") -> None:
        """Send one frame, its payload as given (not copied into the head: the transport
        sends it straight when the kernel's buffer has room); wait while the kernel's buffer
        (and the transport's) is full."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the channel is closed")
        self._transport.write(head)
        if payload:
            self._transport.write(payload)
        while self._paused:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self._closed
