"""Host end of the agent channel: requests with replies, and a stream of events.

The agent is untrusted code's neighbour, so everything it sends is validated here before it
reaches the rest of the library: replies must answer a request we made, events must have
the fields and types we expect. A violation, or the agent going away, breaks the channel:
every pending request fails with :class:`SandboxBroken` and ``on_lost`` is called once.
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

_ERRORS: dict[str, type[errors.SandboxError]] = {
    "process_not_found": errors.ProcessNotFound,
    "spawn_failed": errors.SpawnFailed,
    "path_outside_sandbox": errors.PathOutsideSandbox,
    "file_not_found": errors.FileNotFound,
    "file_too_large": errors.FileTooLarge,
    "permission_denied": errors.FilePermissionDenied,
    "file_error": errors.FileOpError,
    "protocol_error": errors.ProtocolError,
}

# Event name -> required fields and their types. Anything else from the agent is a violation.
_EVENTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "ready": {"pid": int},
    "out": {"pid": int, "stream": str},
    "exit": {"pid": int, "exit_code": int},
}
_STREAMS = frozenset({"stdout", "stderr", "pty"})


def error_from_reply(err: object) -> errors.SandboxError:
    if not isinstance(err, dict):
        return errors.ProtocolError("the agent sent a malformed error reply")
    code = str(err.get("code", ""))
    message = str(err.get("message", "unknown error"))[:2000]
    if code == "invalid_input":
        return errors.SandboxError(message, code=errors.ErrorCode.INVALID_INPUT)
    return _ERRORS.get(code, errors.BackendError)(message)


class Channel:
    def __init__(self, sock: socket.socket, on_event: EventHandler) -> None:
        self._sock = sock
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
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
        fut: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[req_id] = fut
        if on_reply is not None:
            self._hooks[req_id] = on_reply
        try:
            self._writer.write(protocol.encode({"op": op, "id": req_id, **fields}, payload))
            await self._writer.drain()
            header, data = await fut
        except (ConnectionError, OSError) as exc:
            self._lose(f"channel write failed: {exc}")
            raise errors.SandboxBroken(f"the sandbox is gone: {self.lost_reason}") from exc
        finally:
            self._pending.pop(req_id, None)
            self._hooks.pop(req_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the channel: retrieved, so it is not logged
        if "error" in header:
            raise error_from_reply(header["error"])
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
            fut = self._pending.get(header["re"]) if isinstance(header["re"], int) else None
            if fut is None:
                raise protocol.FrameError(f"reply to an unknown request {header['re']!r}")
            hook = self._hooks.pop(header["re"], None)
            if hook is not None and "error" not in header:
                hook(header)
            if not fut.done():
                fut.set_result((header, payload))
            return
        ev = header.get("ev")
        shape = _EVENTS.get(ev) if isinstance(ev, str) else None
        if shape is None:
            raise protocol.FrameError(f"unknown event {ev!r}")
        for key, typ in shape.items():
            value = header.get(key)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise protocol.FrameError(f"event {ev!r} has a bad {key!r}: {value!r}")
        if ev == "out" and header["stream"] not in _STREAMS:
            raise protocol.FrameError(f"unknown stream {header['stream']!r}")
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
