"""Interactive PTY sessions: the I/O driver around the sans-IO expect engine.

A :class:`PtySession` is a shell on a terminal the guest agent allocated inside the box
(so every backend gets it). One pump task reads the shell's output events and hands each
chunk, as it arrives, to three consumers:

* the session's :class:`~corral.sessions.expect.ExpectBuffer` (through the waiting
  :class:`~corral.sessions.expect.Expecter` when an ``expect`` is pending, which is what makes an
  expect resolve on the very chunk that completes the match: there is no polling interval);
* a small raw tail of recent output, replayed to a human who attaches;
* watchers, such as attached terminals once the session is shared
  (:mod:`corral.sessions.attach`), so a human sees what the agent sees and the agent's
  ``expect`` keeps seeing everything while the human types.

This module knows nothing of sockets: sharing is the attach server watching a session and
asking to be told when it closes (:meth:`PtySession.on_close`).

::

    sh = await sb.shell()
    await sh.write("terraform apply\\n")
    m = await sh.expect("Enter a value:", timeout=120)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from corral import errors
from corral.processes import Listener, Process, Request, end_all
from corral.sessions.expect import Case, ExpectBuffer, Expecter, Match

if TYPE_CHECKING:
    from corral.sessions.batch import BatchResult, BatchStep

__all__ = ["PtySession", "SessionRegistry", "to_case"]

# Raw output kept for replay on attach: enough for a full screen of a wide terminal.
TAIL_BYTES = 64 * 1024
DEFAULT_TIMEOUT = 30.0

Watcher = Callable[[bytes | None], None]  # a chunk of output, or None at the end
CloseHook = Callable[[], Awaitable[None]]


def to_case(case: Case | Mapping[str, Any]) -> Case:
    """A :class:`Case` from a Case or a tool-shaped dict (pattern, tag, label, respond)."""
    if isinstance(case, Case):
        return case
    if not isinstance(case, Mapping) or "pattern" not in case:
        raise errors.SandboxError(
            f"each case needs a 'pattern' (and optionally tag, label, respond), got {case!r}",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    unknown = set(case) - {"pattern", "tag", "label", "respond"}
    if unknown:
        raise errors.SandboxError(
            f"unknown case field(s) {sorted(unknown)}; use pattern, tag, label, respond",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return Case(case["pattern"], case.get("tag"), case.get("label"), case.get("respond"))


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:
        raise errors.SandboxError(
            f"timeout must be >= 0 seconds or None, got {timeout!r}",
            code=errors.ErrorCode.INVALID_INPUT,
        )


def _check_size(cols: int, rows: int) -> None:
    for name, value in (("cols", cols), ("rows", rows)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise errors.SandboxError(
                f"{name} must be an integer from 1 to 4096, got {value!r}",
                code=errors.ErrorCode.INVALID_INPUT,
            )


class PtySession:
    """A shell on a terminal in the box. Made by ``Sandbox.shell``; no public constructor."""

    def __init__(
        self,
        process: Process,
        shell: str,
        request: Request,
        *,
        cols: int,
        rows: int,
        strip_ansi: bool,
        forget: Callable[[PtySession], None],
    ) -> None:
        self.session_id = str(uuid.uuid4())
        self.shell = shell
        self.process = process
        self.created_at = time.time()
        self.cols, self.rows = cols, rows
        self._request = request
        self._forget = forget
        self._buffer = ExpectBuffer(strip_ansi=strip_ansi)
        self._tail = bytearray()
        self._watchers: list[Watcher] = []
        self._close_hooks: list[CloseHook] = []
        self._waiter: tuple[Expecter, asyncio.Future[Match]] | None = None
        self._reading = False
        self._closed = False
        self._ended = asyncio.Event()
        self._attach_changed = asyncio.Event()
        queue = process.subscribe()
        # Output that arrived between the spawn reply and subscribe() went only to the
        # process's store: take it from there, in the same step, so nothing is lost or doubled.
        early = process.output_bytes("stdout")
        if early:
            self._on_data(early)
        self._pump = asyncio.create_task(self._run_pump(queue), name=f"corral-pty-{process.pid}")

    def __repr__(self) -> str:
        if self.exit_code is not None:
            state = f"exited with status {self.exit_code}"
        else:
            state = "closed" if self._closed else "running"
        return f"<PtySession {self.session_id} {self.shell!r} pid={self.process.pid} {state}>"

    @property
    def exit_code(self) -> int | None:
        """The shell's exit status once it has exited (``-N`` if killed by signal N)."""
        return self.process.exit_code

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or the shell exited: no more input is accepted."""
        return self._closed or self._ended.is_set()

    @property
    def attached(self) -> int:
        """How many terminals (humans) are attached right now."""
        return len(self._watchers)

    async def wait_closed(self) -> int | None:
        """Wait until the shell has exited; returns its exit status."""
        await self._ended.wait()
        return self.exit_code

    async def _run_pump(self, queue: Listener) -> None:
        try:
            while True:
                kind, data = await queue.get()
                if kind == "exit":
                    self._on_end()
                    return
                if isinstance(data, bytes):
                    self._on_data(data)
        finally:
            self.process.unsubscribe(queue)

    def _on_data(self, data: bytes) -> None:
        self._tail += data
        if len(self._tail) > 2 * TAIL_BYTES:  # cut rarely, in one go: amortised O(1)
            del self._tail[: len(self._tail) - TAIL_BYTES]
        waiter = self._waiter
        if waiter is None:
            self._buffer.feed(data)
        else:
            result = waiter[0].feed(data)
            if result is not None and not waiter[1].done():
                waiter[1].set_result(result)
        for watch in list(self._watchers):
            watch(data)

    def _on_end(self) -> None:
        if self._ended.is_set():
            return
        waiter = self._waiter
        if waiter is None:
            self._buffer.feed_eof()
        else:
            result = waiter[0].feed_eof()
            if result is not None and not waiter[1].done():
                waiter[1].set_result(result)
        self._ended.set()
        for watch in list(self._watchers):
            watch(None)
        self._watchers.clear()
        self._notify_attach()

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call ``watcher`` with every chunk of output (None at the end); returns an undo."""
        if self.closed:
            watcher(None)
            return lambda: None
        self._watchers.append(watcher)
        self._notify_attach()

        def unwatch() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
                self._notify_attach()

        return unwatch

    def _notify_attach(self) -> None:
        changed, self._attach_changed = self._attach_changed, asyncio.Event()
        changed.set()

    async def wait_attached(self, attached: bool = True) -> None:
        """Wait until a human is attached (or, with ``attached=False``, none is)."""
        while (self.attached > 0) != attached:
            await self._attach_changed.wait()

    def recent_output(self, max_lines: int = 24) -> bytes:
        """The last ``max_lines`` lines of raw output (escape sequences included)."""
        tail = bytes(self._tail[-TAIL_BYTES:])
        lines = tail.split(b"\n")
        if len(lines) > max_lines + 1 or len(tail) == TAIL_BYTES:
            # Start at a line boundary so the replay does not open mid escape sequence.
            lines = lines[1:][-(max_lines + 1) :]
        return b"\n".join(lines)

    async def write(self, data: str | bytes) -> None:
        """Send keystrokes to the terminal (``"\\n"`` is Enter, ``"\\x03"`` is Ctrl-C)."""
        self._check_open()
        try:
            await self.process.write(data)
        except errors.ProcessNotFound:
            self._check_open()  # the shell exited under us: say so as a session error
            raise

    async def signal(self, sig: str | int = "SIGINT") -> bool:
        """Signal the terminal's foreground process group, like a key typed at it.

        Returns False when the shell has already exited.
        """
        if self._closed:
            self._check_open()
        return await self.process.signal(sig, group=True)

    async def resize(self, cols: int, rows: int) -> None:
        """Set the window size; the foreground program receives SIGWINCH."""
        _check_size(cols, rows)
        self._check_open()
        await self._request("resize", pid=self.process.pid, cols=cols, rows=rows)
        self.cols, self.rows = cols, rows

    def _check_open(self) -> None:
        if self._closed:
            raise errors.SessionNotFound(f"session {self.session_id} is closed")
        if self._ended.is_set():
            raise errors.SessionNotFound(
                f"session {self.session_id} has ended: its shell exited with status "
                f"{self.exit_code}; open a new shell"
            )

    def read(self) -> str:
        """What the shell printed since the last read or match, consumed (never blocks)."""
        if self._reading:
            raise errors.SessionBusy(
                f"session {self.session_id} has an expect in progress; read after it returns"
            )
        return self._buffer.take()

    async def expect(self, pattern: str, timeout: float | None = DEFAULT_TIMEOUT) -> Match:
        """Wait until ``pattern`` (a regex) matches the output since the last match.

        Timeout and end of output are results (``matched=False``, ``reason``), not errors.
        """
        return await self._expect([Case(pattern)], timeout)

    async def expect_cases(
        self, cases: Sequence[Case | Mapping[str, Any]], timeout: float | None = DEFAULT_TIMEOUT
    ) -> Match:
        """Wait for the first of several cases; a matched case's ``respond`` is sent back
        with ``$1``, ``$2``... replaced by its capture groups."""
        result = await self._expect([to_case(c) for c in cases], timeout)
        if result.matched and result.respond:
            await self.write(result.respond)
        return result

    async def _expect(self, cases: Sequence[Case], timeout: float | None) -> Match:
        _check_timeout(timeout)
        if self._reading:
            raise errors.SessionBusy(
                f"session {self.session_id} already has an expect in progress; one reader at a time"
            )
        expecter = Expecter(self._buffer, cases)  # validates before we claim the session
        self._reading = True
        try:
            result = expecter.check()
            if result is not None:
                return result
            future: asyncio.Future[Match] = asyncio.get_running_loop().create_future()
            self._waiter = (expecter, future)
            try:
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                # A match that landed just as the deadline fired is kept by the Expecter.
                return expecter.timeout()
        finally:
            self._waiter = None
            self._reading = False

    async def batch(
        self,
        steps: Sequence[BatchStep | Mapping[str, Any]],
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> BatchResult:
        """Run send / expect / expect_cases steps in order, stopping at the first failure;
        ``timeout`` applies to each expect step without its own ``timeout_secs``."""
        if self._reading:
            raise errors.SessionBusy(f"session {self.session_id} already has an expect in progress")

        from corral.sessions.batch import run_batch  # its step models: only when batching

        return await run_batch(self, steps, timeout)

    async def close(self, grace: float | None = None) -> int | None:
        """Hang up the terminal and end what runs on it: SIGTERM to the shell's group and its
        foreground job's, SIGHUP to the shell, then SIGKILL to both groups once ``grace``
        seconds (default ``limits.kill_grace_secs``) have passed and anything of them is
        left. Returns the shell's exit status once it is reaped. Idempotent."""
        if self._closed:
            return self.exit_code
        self._closed = True
        self._forget(self)
        if not self._ended.is_set():
            await end_all([self.process], grace, hang_up=[self.process])
        await self._stop_pump()
        await self._run_close_hooks()
        return self.exit_code

    def on_close(self, hook: CloseHook) -> None:
        """Await ``hook()`` once the session is closed (by ``close()`` or its sandbox)."""
        self._close_hooks.append(hook)

    async def _run_close_hooks(self) -> None:
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            await hook()

    async def _abandon(self) -> None:
        """The sandbox is going away (it kills everything): end without talking to the box."""
        self._closed = True
        self._on_end()
        await self._stop_pump()
        await self._run_close_hooks()

    async def _stop_pump(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump


class SessionRegistry:
    """The open sessions of one sandbox."""

    def __init__(self) -> None:
        self._sessions: dict[str, PtySession] = {}

    async def open(
        self,
        process: Process,
        shell: str,
        request: Request,
        *,
        cols: int,
        rows: int,
        strip_ansi: bool,
    ) -> PtySession:
        session = PtySession(
            process, shell, request, cols=cols, rows=rows, strip_ansi=strip_ansi,
            forget=self._forget,
        )  # fmt: skip
        self._sessions[session.session_id] = session
        return session

    def _forget(self, session: PtySession) -> None:
        self._sessions.pop(session.session_id, None)

    def get(self, session_id: str) -> PtySession:
        session = self._sessions.get(session_id)
        if session is None:
            raise errors.SessionNotFound(
                f"no session {session_id!r} in this sandbox; open_shell starts one"
            )
        return session

    def list(self) -> list[PtySession]:
        return list(self._sessions.values())

    async def aclose(self) -> None:
        for session in list(self._sessions.values()):
            self._forget(session)
            await session._abandon()
