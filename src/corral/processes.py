"""Processes started in a box: host-side handles and the registry that tracks them.

Output is stored on the host as it arrives (the agent never buffers it), capped per stream
with head and tail kept, so a flood cannot exhaust the host and an agent can read partial
output of a running process at any time.

Ending a process is trio's way: SIGTERM to its process group, a grace period
(``limits.kill_grace_secs``), SIGKILL to the group, and the exit is reported once nothing of the
group is left. A timeout does that, and so does cancelling a ``wait()``: a cancelled waiter
never leaves its process running.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import shlex
import signal as _signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Literal

from corral import errors
from corral.models import Ending, ProcessInfo, ProcessStats, ProcessStatus, WaitResult
from corral.output import HeadTailBuffer, text_bytes

Stream = Literal["stdout", "stderr", "pty"]
Request = Callable[..., Awaitable[tuple[dict[str, Any], bytes]]]
"""A request to the guest agent: (op, payload, **fields) -> (reply header, reply payload)."""
REAP_MARGIN = 5.0
"""Seconds past the grace a terminated process's exit may take to be reported (the agent waits
for the whole group to go after the SIGKILL) before ``terminate`` stops waiting."""

_ending: set[asyncio.Task[Any]] = set()
"""Terminations that outlive a cancelled caller (a strong reference until they are done)."""


def end_in_background(proc: Process) -> None:
    """Terminate ``proc`` in a task of its own: a cancelled caller cannot wait for it."""
    task = asyncio.ensure_future(proc.terminate())
    _ending.add(task)
    task.add_done_callback(_forget)


def _forget(task: asyncio.Task[Any]) -> None:
    _ending.discard(task)
    if not task.cancelled():
        task.exception()  # a box that went away meanwhile: nothing left to end


async def end_all(
    procs: Collection[Process], grace: float | None = None, *, hang_up: Collection[Process] = ()
) -> None:
    """End many processes at once: SIGTERM to every group, one grace for all of them, SIGKILL
    to what is left, and the reaps; at most the longest grace plus :data:`REAP_MARGIN` seconds,
    however many there are. ``grace`` defaults to each process's ``kill_grace``.

    ``hang_up``: shells on a terminal, which ignore SIGTERM; each also gets a SIGHUP (what
    closing its terminal sends), right after the SIGTERM of its group."""
    procs = [p for p in procs if p.exit_code is None]
    if not procs:
        return
    graces = [p.kill_grace if grace is None else max(0.0, grace) for p in procs]
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(graces) + REAP_MARGIN):
            # A box that stopped answering fails these; the wait below then ends with it.
            await asyncio.gather(
                *(p._start_ending(g) for p, g in zip(procs, graces, strict=True)),
                return_exceptions=True,
            )
            await asyncio.gather(
                *(p.signal("SIGHUP", group=False) for p in hang_up if p.exit_code is None),
                return_exceptions=True,
            )
            await asyncio.gather(*(p._exited.wait() for p in procs))


def checked_timeout(value: object, *, poll: bool = False) -> float | None:
    """``value`` as a timeout in seconds: None (none), or a finite number above 0 (any
    finite number where ``poll``: 0 or less asks without waiting); anything else is a clear
    error, raised before anything starts."""
    if value is None:
        return None
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (poll or value > 0)
    ):
        return float(value)
    floor = "" if poll else " greater than 0"
    raise errors.SandboxError(
        f"timeout must be a number of seconds{floor}, or None for none (got {value!r})",
        code=errors.ErrorCode.INVALID_INPUT,
    )


def parse_signal(sig: str | int) -> int:
    """``"SIGTERM"``, ``"term"``, ``15`` -> 15; anything else is a clear error."""
    if isinstance(sig, int) and not isinstance(sig, bool):
        if 0 < sig < _signal.NSIG:
            return sig
    elif isinstance(sig, str):
        name = sig.strip().upper()
        if name.isdigit():
            return parse_signal(int(name))
        name = name if name.startswith("SIG") else "SIG" + name
        value = getattr(_signal.Signals, name, None)
        if value is not None:
            return int(value)
    raise errors.SandboxError(
        f"unknown signal {sig!r}; use a name like SIGTERM, SIGINT, SIGKILL or a number",
        code=errors.ErrorCode.INVALID_INPUT,
    )


WRITE_CHUNK = 8 << 20
"""Bytes of stdin per ``write`` request (a message to the box holds at most 16 MiB)."""
HOLD_BYTES = 4 << 20
"""A subscriber this far behind holds its process (see :class:`Listener`)."""
RELEASE_BYTES = 1 << 20
"""... until every subscriber is back under this."""


class Skipped:
    """Output an observer's queue left out (it was :data:`HOLD_BYTES` behind): ``size``
    bytes at this place in the stream."""

    __slots__ = ("size",)

    def __init__(self) -> None:
        self.size = 0


Event = tuple[str, bytes | int | Skipped]
"""("stdout" | "stderr" | "pty", bytes), ("skipped", Skipped) for an observer that fell
behind, and finally ("exit", code)."""


class Listener(asyncio.Queue[Event]):
    """One subscriber's queue of a process's events, counting the bytes not yet taken. Past
    :data:`HOLD_BYTES` the process is held: the agent stops reading its stdout and stderr,
    so it blocks on a full pipe as it would behind any slow reader, until the subscriber is
    back under :data:`RELEASE_BYTES`. A reader that stops reading costs the host 4 MiB, not
    what the box can print. (A process on a terminal is never held.)

    An observer (``hold=False``: ``corral logs -f`` of a background process, which must not
    slow the process it watches) is never waited for: past :data:`HOLD_BYTES` what arrives is
    left out of its queue, counted in one ``("skipped", Skipped)`` event where it was."""

    def __init__(self, process: Process, *, hold: bool = True) -> None:
        super().__init__()
        self.backlog = 0
        self.hold = hold
        self._process = process
        self._gap: Skipped | None = None

    def put_nowait(self, item: Event) -> None:
        data = item[1]
        if isinstance(data, bytes) and not self.hold and self.backlog > HOLD_BYTES:
            if self._gap is None:
                self._gap = Skipped()
                super().put_nowait(("skipped", self._gap))
            self._gap.size += len(data)
            return
        self._gap = None
        super().put_nowait(item)
        if isinstance(data, bytes):
            self.backlog += len(data)
            if self.hold and self.backlog > HOLD_BYTES:
                self._process._flow()

    def get_nowait(self) -> Event:  # Queue.get() takes its item through this
        item = super().get_nowait()
        if isinstance(item[1], bytes):
            self.backlog -= len(item[1])
            if self.backlog < RELEASE_BYTES and self._process._held:
                self._process._flow()
        return item


class Process:
    """A process in the box. Made by ``Sandbox.spawn``; no public constructor."""

    def __init__(
        self,
        pid: int,
        argv: list[str],
        output_cap: int,
        request: Request,
        *,
        kill_grace: float = 2.0,
    ) -> None:
        self.pid = pid
        self.argv = argv
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self._request = request
        self._buffers: dict[str, HeadTailBuffer] = {
            "stdout": HeadTailBuffer(output_cap),
            "stderr": HeadTailBuffer(output_cap),
        }
        self._exited = asyncio.Event()
        self.exit_code: int | None = None
        self.duration: float | None = None
        self.final_usage: tuple[float, int] | None = None
        """(CPU seconds, peak RSS bytes) the box reported at exit."""
        self.timed_out = False
        self.kill_grace = kill_grace
        """Seconds between SIGTERM and SIGKILL when this process is ended (``terminate``)."""
        self.lost = False
        """True when the box died under the process (it is reported as killed)."""
        self._terminating = False
        self._listeners: list[Listener] = []
        self._held = False
        """Whether the agent was last asked to hold this process's output."""
        self._flowing: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = "running" if self.exit_code is None else f"exited with status {self.exit_code}"
        return f"<Process pid={self.pid} {self.command!r}: {state}>"

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def status(self) -> ProcessStatus:
        return "running" if self.exit_code is None else "exited"

    @property
    def ended(self) -> Ending | None:
        """How it ended (None while running); ``oom_killed`` is the sandbox's to tell."""
        if self.exit_code is None:
            return None
        if self.lost:
            return "lost"
        if self.timed_out:
            return "timed_out"
        return "signalled" if self.exit_code < 0 else "exited"

    # Fed by the sandbox's event dispatch.
    def _on_output(self, stream: str, data: bytes) -> None:
        self._buffers["stdout" if stream == "pty" else stream].append(data)
        for q in self._listeners:
            q.put_nowait((stream, data))

    def _on_exit(self, exit_code: int, duration: float | None) -> None:
        self.exit_code = exit_code
        self.duration = duration if duration is not None else time.monotonic() - self._t0
        self._exited.set()
        for q in self._listeners:
            q.put_nowait(("exit", exit_code))

    def _lost(self) -> None:
        """The box died under the process: report it as killed."""
        if self.exit_code is None:
            self.lost = True
            self._on_exit(-int(_signal.SIGKILL), None)

    def subscribe(self, *, hold: bool = True) -> Listener:
        """A queue of ("stdout"|"stderr"|"pty", bytes) and finally ("exit", code); one that
        falls behind holds the process (:class:`Listener`): read it, or unsubscribe.
        ``hold=False``: an observer, which skips output rather than hold the process."""
        q = Listener(self, hold=hold)
        if self.exit_code is not None:
            q.put_nowait(("exit", self.exit_code))
        self._listeners.append(q)
        return q

    def unsubscribe(self, q: Listener) -> None:
        if q in self._listeners:
            self._listeners.remove(q)
            if self._held:
                self._flow()

    def _flow(self) -> None:
        """Bring the agent's hold of this process's output in line with its subscribers
        (one request at a time, in a task: called from a queue's put or get)."""
        if self._flowing is None or self._flowing.done():
            self._flowing = asyncio.get_running_loop().create_task(self._send_flow())

    def _hold_wanted(self) -> bool:
        if self.exit_code is not None:
            return False
        holding = [q for q in self._listeners if q.hold]
        if self._held:
            return any(q.backlog >= RELEASE_BYTES for q in holding)
        return any(q.backlog > HOLD_BYTES for q in holding)

    async def _send_flow(self) -> None:
        while (hold := self._hold_wanted()) != self._held:
            self._held = hold
            try:
                await self._request("flow", pid=self.pid, hold=hold)
            except errors.SandboxError:
                return  # exited meanwhile, or the box is gone: nothing is held

    def output(self, stream: Literal["stdout", "stderr"] = "stdout") -> str:
        """Output captured so far (partial while running, complete after exit)."""
        return self._buffers[stream].render()

    def output_bytes(self, stream: Literal["stdout", "stderr"] = "stdout") -> bytes:
        return self._buffers[stream].getvalue()

    def output_cut(self, stream: Literal["stdout", "stderr"] = "stdout") -> tuple[int, int] | None:
        """Where :meth:`output_bytes` misses the middle of ``stream`` (over the output cap):
        (the offset of the gap in those bytes, how many bytes were dropped there), or None
        when it holds all of it."""
        buffer = self._buffers[stream]
        at = buffer.cut_at
        return None if at is None else (at, buffer.dropped)

    @property
    def output_held(self) -> bool:
        """Whether the box stopped reading this process's output because a subscriber (an
        ``exec_stream``, a follow over the API) is 4 MiB behind: it blocks writing until
        that reader catches up or goes away."""
        return self._held

    @property
    def truncated(self) -> bool:
        return any(b.truncated for b in self._buffers.values())

    async def wait(self, timeout: float | None = None) -> WaitResult:
        """Wait for exit; on timeout the process keeps running and ``status`` is ``timeout``.

        Cancelling the wait (``task.cancel()``, an enclosing ``asyncio.timeout``) ends the
        process as :meth:`terminate` does, waits for that, then lets the cancellation through.
        """
        timeout = checked_timeout(timeout, poll=True)
        if timeout is not None and timeout <= 0:
            if self.exit_code is None:
                return self._timeout_result(0)
        else:
            try:
                async with asyncio.timeout(timeout):
                    await self._exited.wait()
            except TimeoutError:
                return self._timeout_result(timeout or 0)
            except asyncio.CancelledError:
                await self._end_on_cancel()
                raise
        return WaitResult(pid=self.pid, status="exited", exit_code=self.exit_code)

    async def _end_on_cancel(self) -> None:
        """Terminate after a cancellation, in a task of its own: a second cancellation stops
        this wait for it, never the termination."""
        if self.exit_code is not None:
            return
        if not self._terminating:
            end_in_background(self)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.kill_grace + REAP_MARGIN):
                await self._exited.wait()

    async def terminate(self, grace: float | None = None) -> WaitResult:
        """End the process: SIGTERM to its process group, then SIGKILL to the group once
        ``grace`` seconds (default ``limits.kill_grace_secs``) have passed and anything of it
        is left; returns once the agent has reaped it and nothing of the group remains.

        ``status`` is ``timeout`` only when the agent did not report the exit within the grace
        plus :data:`REAP_MARGIN` seconds (a box that stopped answering).
        """
        grace = self.kill_grace if grace is None else max(0.0, grace)
        await self._start_ending(grace)
        return await self.wait(grace + REAP_MARGIN)

    async def _start_ending(self, grace: float) -> None:
        """SIGTERM to the group now and SIGKILL after ``grace`` (the agent keeps the time);
        returns at once: the exit event reports the end."""
        if self.exit_code is None:
            self._terminating = True
            with contextlib.suppress(errors.ProcessNotFound):  # exiting: its event follows
                await self._request("terminate", pid=self.pid, grace=grace)

    def _timeout_result(self, timeout: float) -> WaitResult:
        return WaitResult(
            pid=self.pid,
            status="timeout",
            message=f"process still running after {round(timeout * 1000)}ms",
        )

    async def signal(self, sig: str | int = "SIGTERM", *, group: bool = True) -> bool:
        """Send a signal to the process group (default) or the process; False if gone."""
        number = parse_signal(sig)
        if self.exit_code is not None:
            return False
        reply, _ = await self._request("signal", pid=self.pid, signal=number, group=group)
        return bool(reply.get("delivered"))

    async def kill(self) -> bool:
        return await self.signal("SIGKILL")

    async def write(self, data: bytes | str, *, eof: bool = False) -> None:
        """Write to stdin (spawned with ``stdin="pipe"`` or on a PTY); any size, sent in
        pieces a message to the box can hold."""
        view = memoryview(text_bytes(data))
        for start in range(0, max(len(view), 1), WRITE_CHUNK):
            last = start + WRITE_CHUNK >= len(view)
            piece = view[start : start + WRITE_CHUNK]
            await self._request("write", piece, pid=self.pid, eof=eof and last)

    async def close_stdin(self) -> None:
        await self._request("close_stdin", pid=self.pid)

    async def stats(self) -> ProcessStats:
        if self.exit_code is not None:  # the final figures: CPU used, peak memory
            cpu, rss = self.final_usage or (0.0, 0)
            return ProcessStats(self.pid, "exited", cpu, rss, 0)
        reply, _ = await self._request("stats", pid=self.pid)
        return ProcessStats(
            pid=self.pid,
            status=str(reply.get("state", "unknown")),
            cpu_seconds=float(reply.get("cpu_seconds", 0.0)),
            rss_bytes=int(reply.get("rss_bytes", 0)),
            processes=int(reply.get("processes", 0)),
        )

    def info(self) -> ProcessInfo:
        duration = self.duration if self.duration is not None else time.monotonic() - self._t0
        return ProcessInfo(
            pid=self.pid,
            command=self.command,
            status=self.status,
            exit_code=self.exit_code,
            started_at=self.started_at,
            duration=duration,
            timed_out=self.timed_out,
        )


class ProcessRegistry:
    """Running processes plus the most recent ``max_tracked`` finished ones."""

    def __init__(self, max_tracked: int | None = 64) -> None:
        self.max_tracked = max_tracked
        self._procs: OrderedDict[int, Process] = OrderedDict()

    def add(self, proc: Process) -> None:
        self._procs[proc.pid] = proc
        self._evict()

    def get(self, pid: int) -> Process:
        proc = self._procs.get(pid)
        if proc is None:
            raise errors.ProcessNotFound(
                f"no process with pid {pid} in this sandbox; list_processes shows the known ones"
            )
        return proc

    def find(self, pid: int) -> Process | None:
        return self._procs.get(pid)

    def __contains__(self, pid: int) -> bool:
        return pid in self._procs

    def list(self) -> builtins.list[Process]:
        return list(self._procs.values())

    def running(self) -> builtins.list[Process]:
        return [p for p in self._procs.values() if p.exit_code is None]

    def _evict(self) -> None:
        if self.max_tracked is None:
            return
        finished = [pid for pid, p in self._procs.items() if p.exit_code is not None]
        for pid in finished[: max(0, len(finished) - self.max_tracked)]:
            del self._procs[pid]

    def on_exit(self) -> None:
        self._evict()
