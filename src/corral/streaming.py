"""Streaming exec: output events of a long-running command as they happen.

::

    async for event in sb.exec_stream("make test"):
        match event:
            case Stdout(data): ...
            case Stderr(data): ...
            case Exited(code): ...

    async with sb.exec_stream(["tail", "-f", "app.log"]) as stream:  # ended on exit
        async for event in stream: ...

    stream = await sb.exec_stream(["cat"], stdin="pipe")  # the handle, started

``sb.exec_stream(...)`` returns a :class:`PendingExecStream`: awaiting it, iterating it or
entering it starts the command (once) and gives the :class:`ExecStream`.

With ``stdin="pipe"`` the stream is also a writer (``write``, ``close_stdin``); with
``tty=True`` the command runs on a terminal and everything it prints arrives as ``Stdout``.
Events are queued as they arrive, so a consumer that is slow never loses output, and the
host-side store of the process (capped, head and tail) still has it afterwards. A consumer
4 MiB behind holds the command (the box stops reading its output, so it blocks writing, as
behind any slow pipe) until it catches up: a stream nobody reads costs the host 4 MiB, not
what the box can print. Leaving an ``async for`` early ends the command, as leaving an
``async with`` block does (SIGTERM, ``limits.kill_grace_secs``, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from corral import errors
from corral.processes import Process

__all__ = ["ExecEvent", "ExecStream", "Exited", "PendingExecStream", "Stderr", "Stdout"]


@dataclass(frozen=True, slots=True)
class Stdout:
    """Bytes the command wrote to its stdout."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Stderr:
    """Bytes the command wrote to its stderr."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Exited:
    """The command ended; always the stream's last event."""

    code: int
    """Exit status; ``-N`` when killed by signal N."""


ExecEvent = Stdout | Stderr | Exited


class ExecStream:
    """Events of one command. Made by ``Sandbox.exec_stream``; no public constructor."""

    def __init__(self, process: Process, *, stdin: bool, tty: bool, timeout: float | None) -> None:
        self.process = process
        self.tty = tty
        self.timed_out = False
        self._stdin_open = stdin or tty
        self._queue = process.subscribe()
        self._early: list[ExecEvent] = []
        # Output that arrived before we subscribed sits only in the process's store: replay
        # it first (taken in the same step as subscribe(), so nothing is lost or doubled).
        for stream, event in (("stdout", Stdout), ("stderr", Stderr)):
            data = process.output_bytes(stream)  # type: ignore[arg-type]
            if data:
                self._early.append(event(data))
        self._finished = False
        self._deadline: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._on_timeout)

    def __repr__(self) -> str:
        return f"<ExecStream pid={self.pid} {self.process.command!r} tty={self.tty}>"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        return self.process.exit_code

    @property
    def stdin(self) -> ExecStream | None:
        """The writer (this stream) when started with ``stdin="pipe"`` or ``tty=True``."""
        return self if self._stdin_open else None

    def _on_timeout(self) -> None:
        if self.process.exit_code is None:
            self.timed_out = self.process.timed_out = True
            task = asyncio.get_running_loop().create_task(self._end())
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _end(self) -> None:
        """A timeout ends the command as ``run``'s does: SIGTERM, the grace, SIGKILL."""
        with contextlib.suppress(errors.SandboxError):
            await self.process.terminate()

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self

    async def __anext__(self) -> ExecEvent:
        if self._early:
            return self._early.pop(0)
        if self._finished:
            raise StopAsyncIteration
        kind, data = await self._queue.get()
        if kind == "exit":
            assert isinstance(data, int)
            self._finish()
            return Exited(data)
        assert isinstance(data, bytes)
        return Stderr(data) if kind == "stderr" else Stdout(data)

    def _finish(self) -> None:
        self._finished = True
        if self._deadline is not None:
            self._deadline.cancel()
        self.process.unsubscribe(self._queue)

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for exit; the status. Events not consumed are dropped from this stream, and
        it takes no more (so nothing it would hold back stops the command ending)."""
        self._early.clear()
        self._finished = True  # the stream's own timeout still stands until the exit
        self.process.unsubscribe(self._queue)
        result = await self.process.wait(timeout)
        if result.status == "timeout":
            raise errors.Timeout(f"{self.process.command!r} still running after {timeout:g} s")
        self._finish()
        assert self.process.exit_code is not None
        return self.process.exit_code

    async def write(self, data: bytes | str) -> None:
        if not self._stdin_open:
            raise errors.SandboxError(
                "this stream has no stdin; start it with stdin='pipe' or tty=True",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        await self.process.write(data)

    async def close_stdin(self) -> None:
        """Send end of input (on a terminal: Ctrl-D at the start of a line)."""
        if not self._stdin_open:
            return
        if self.tty:
            await self.process.write(b"\x04")
        else:
            self._stdin_open = False
            await self.process.close_stdin()

    async def signal(self, sig: str | int = "SIGTERM") -> bool:
        return await self.process.signal(sig)

    async def kill(self) -> bool:
        return await self.process.kill()

    async def __aenter__(self) -> ExecStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process.exit_code is None:  # left early: SIGTERM, the grace, SIGKILL
            self._finish()  # first: nobody reads what it prints meanwhile, so nothing holds it
            with contextlib.suppress(errors.SandboxError):
                await self.process.terminate()
        self._finish()


class PendingExecStream:
    """What ``Sandbox.exec_stream`` returns: the command starts on first use, once.

    * ``await`` it for the :class:`ExecStream` (to write to stdin, wait, signal...);
    * ``async for event in`` it directly;
    * ``async with`` it: the stream, and the command ended on exit if still running
      (SIGTERM, ``limits.kill_grace_secs``, SIGKILL).
    """

    def __init__(self, start: Callable[[], Awaitable[ExecStream]], command: str) -> None:
        self._start = start
        self._command = command
        self._stream: ExecStream | None = None
        self._starting = False

    def __repr__(self) -> str:
        if self._stream is not None:
            return repr(self._stream)
        return f"<PendingExecStream {self._command!r} not started>"

    async def _started(self) -> ExecStream:
        if self._stream is None:
            if self._starting:
                raise errors.SandboxError(
                    f"{self._command!r} is already being started; await it once and share "
                    "the stream",
                    code=errors.ErrorCode.INVALID_INPUT,
                )
            self._starting = True
            try:
                self._stream = await self._start()
            finally:
                self._starting = False
        return self._stream

    def __await__(self) -> Generator[Any, None, ExecStream]:
        return self._started().__await__()

    @property
    def timed_out(self) -> bool:
        """Whether the ``timeout`` given to ``exec_stream`` ended the command."""
        return self._stream is not None and self._stream.timed_out

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self._events()

    async def _events(self) -> AsyncGenerator[ExecEvent, None]:
        """The events; leaving the loop early (``break``, an exception) ends the command:
        the generator's close (asyncio runs it once the loop drops the generator, at once
        in CPython) leaves the stream as ``async with`` does."""
        stream = await self._started()
        try:
            async for event in stream:
                yield event
        finally:
            await stream.__aexit__(None, None, None)

    async def __anext__(self) -> ExecEvent:
        stream = await self._started()
        return await stream.__anext__()

    async def __aenter__(self) -> ExecStream:
        return await self._started()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._stream is not None:
            await self._stream.__aexit__(exc_type, exc, tb)
