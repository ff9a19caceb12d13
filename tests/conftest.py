"""Shared fixtures: real sandboxes, skipped with a reason where the host cannot make them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import linecache
import logging
import os
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from corral.backends import unavailable_reason
from corral.sessions.pty import PtySession

PROMPT = r"[$#] $"
"""The prompt of /bin/sh (dash) in a box's PTY session (``#`` where commands are box root:
rootless with one id)."""


ROOTLESS_RUN = os.geteuid() != 0 and os.environ.get("CORRAL_TEST_ROOTLESS") == "1"
"""This session is the rootless slice: tests/test_rootless.py runs the contract and attack
suites as an unprivileged test user with ``CORRAL_TEST_ROOTLESS=1``. Their boxes are then
rootless boxes (bwrap's rootless mode, crun and runc rootless)."""


def rootless_skip(why: str) -> pytest.MarkDecorator:
    """Skip in the rootless slice: ``why`` names the root-mode mechanism the test attacks
    and what stands in for it in rootless mode (SECURITY.md, "Rootless")."""
    return pytest.mark.skipif(ROOTLESS_RUN, reason=f"rootless: {why}")


def _one_id() -> bool:
    if not ROOTLESS_RUN:
        return False
    from corral.backends.host import subids

    return not subids.probe().mapped


ONE_ID = _one_id()
"""The rootless slice's user has no subordinate ids: commands run as box root, the guest
agent's id (with no capability at all), so they can signal the agent, ending their own box,
and list its descriptor numbers (SECURITY.md, Rootless: "one id")."""


COMMAND_UID = "0" if ONE_ID else "1000"
"""The commands' uid inside a box (box root in the rootless slice with one id)."""


def one_id_skip(what: str) -> pytest.MarkDecorator:
    """Skip where commands would need an id other than the agent's: ``what`` they then can."""
    return pytest.mark.skipif(
        ONE_ID,
        reason=f"rootless, one id: commands are box root, the agent's id (no capabilities): "
        f"{what} (with subordinate ids this holds; SECURITY.md, Rootless)",
    )


def _bwrap_unusable() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if os.geteuid() != 0 and not ROOTLESS_RUN:
        return (
            "the bwrap backend needs root on the host (as a user, the contract and attack "
            "suites run in the rootless slice: make test-rootless)"
        )
    if ROOTLESS_RUN:
        from corral.backends.host import subids

        return subids.userns_problem()
    return None


BWRAP_SKIP = _bwrap_unusable()

# The backend contract: every test that takes the ``sandbox`` (or ``box_policy``) fixture runs
# on each of these. ``CORRAL_TEST_BACKENDS=bwrap,oci-runc`` narrows the set. The microVM
# backend has its own, smaller module (its boxes boot in seconds under TCG).
BACKENDS: dict[str, dict[str, Any]] = {
    "bwrap": {},
    "oci-runc": {"backend": "oci", "runtime": "runc"},
    "oci-crun": {"backend": "oci", "runtime": "crun"},
    "oci-runsc": {"backend": "oci", "runtime": "runsc"},
    "microvm": {"backend": "microvm"},
}
CONTRACT_BACKENDS = [
    name
    for name in os.environ.get("CORRAL_TEST_BACKENDS", "bwrap,oci-runc,oci-crun").split(",")
    if name in BACKENDS
]


@functools.cache
def backend_skip(name: str) -> str | None:
    """Why the named backend cannot run here (a skip reason), or None."""
    if name == "bwrap" or BWRAP_SKIP:
        return BWRAP_SKIP
    reason = unavailable_reason(Policy(**BACKENDS[name]))
    return f"{name}: {reason}" if reason else None


def backend_policy(name: str, **update: Any) -> Policy:
    """A policy for the named backend (skipping the test when it can't run here)."""
    reason = backend_skip(name)
    if reason:
        pytest.skip(reason)
    return Policy(**{**BACKENDS[name], **update})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ROOTLESS_RUN:  # the slice: the attack suite, and the contract tests of other files
        security = Path(__file__).parent / "security"
        keep = [
            i
            for i in items
            if i.path.is_relative_to(security) or "backend_name" in getattr(i, "fixturenames", ())
        ]
        if len(keep) != len(items):
            kept = set(map(id, keep))
            config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
            items[:] = keep
    for item in items:
        if item.get_closest_marker("needs_bwrap") and BWRAP_SKIP:
            item.add_marker(pytest.mark.skip(reason=BWRAP_SKIP))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture(params=CONTRACT_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


SLOW_CALLBACK_SECS = float(os.environ.get("CORRAL_SLOW_CALLBACK_MS", "20")) / 1000
"""A callback (one step of a task) holding the event loop longer than this fails a contract
test. 20 ms by default; ``CORRAL_SLOW_CALLBACK_MS`` changes it.

A test failed by this watch alone runs once more (pyproject's ``--only-rerun``): on a shared,
oversubscribed host a GIL hand-off to a thread the OS has paused can hold one callback past
20 ms at random, about 1% of contract tests at a load of 10 on 2 cores. Code that really
blocks the loop does so on every run and still fails; the rerun shows as ``R`` in the
report, so a test that needs it is visible."""


def _cpu_wait() -> tuple[float, float]:
    """Seconds this thread has waited for a CPU while runnable (schedstat), and seconds in
    which any task of the host waited for one (CPU pressure, "some"), both cumulative."""
    own = stall = 0.0
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            own = int(f.read().split()[1]) / 1e9
        with open("/proc/pressure/cpu", "rb") as f:
            stall = int(f.readline().rsplit(b"=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    return own, stall


class _Sampler:
    """Where the loop's thread is while a callback runs: a thread looks at its stack every few
    milliseconds, so a report of a slow callback can say which code held the loop (asyncio
    names only the task, and the step is often the box's start or close deep below it)."""

    PERIOD = 0.004

    def __init__(self) -> None:
        self.target = threading.get_ident()
        self.samples: Counter[str] = Counter()
        self.active = False
        self.stopped = threading.Event()
        self.gc_seconds = self.gc_started = 0.0
        gc.callbacks.append(self.on_gc)
        self.thread = threading.Thread(target=self._run, name="loop-sampler", daemon=True)
        self.thread.start()

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """gc's callback: the time collections took, whichever thread ran them (a collection
        in any thread holds the GIL, so the loop waits for it too)."""
        if phase == "start":
            self.gc_started = time.perf_counter()
        elif self.gc_started:
            self.gc_seconds += time.perf_counter() - self.gc_started
            self.gc_started = 0.0

    def _run(self) -> None:
        while not self.stopped.wait(self.PERIOD):
            if not self.active:
                continue
            frame = sys._current_frames().get(self.target)
            if frame is not None:
                self.samples[_where(frame)] += 1

    def close(self) -> None:
        gc.callbacks.remove(self.on_gc)
        self.stopped.set()
        self.thread.join(5)


def _where(frame: Any) -> str:
    """The innermost frames of a stack, ours first (site-packages and the stdlib only where
    nothing of ours is on the stack)."""
    frames: list[str] = []
    while frame is not None and len(frames) < 40:
        code = frame.f_code
        frames.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    ours = [f for f in frames if not f.startswith(("base_events.py", "events.py", "<frozen"))]
    return " < ".join(ours[:4])


class _SlowCallbacks(logging.Handler):
    """Collects asyncio's debug-mode reports of callbacks over ``slow_callback_duration``.

    asyncio measures wall time. On a shared, oversubscribed host a callback also "takes"
    the time its thread, a thread it waits for (the GIL's holder) or a vforked child waited
    for a CPU. So each report is checked against the time during that callback in which
    this thread, or any task of the host, waited for a CPU (kept by :meth:`track`): what is
    left must stay under the threshold, unless waiting was most of the callback's time (then
    the difference is noise). On a quiet host the wait is zero and the wall time counts."""

    def __init__(self, threshold: float) -> None:
        super().__init__(logging.WARNING)
        self.threshold = threshold
        self.reports: list[str] = []
        self.last_wait = 0.0
        self.last_where: list[tuple[str, int]] = []
        self.last_gc = 0.0
        self.sampler = _Sampler()

    def track(self, run: Callable[[asyncio.Handle], None]) -> Callable[[asyncio.Handle], None]:
        sampler = self.sampler

        def timed(handle: asyncio.Handle) -> None:
            own, stall = _cpu_wait()
            sampler.samples.clear()
            collecting = sampler.gc_seconds
            sampler.active = True
            try:
                run(handle)
            finally:
                sampler.active = False
                own_after, stall_after = _cpu_wait()
                self.last_wait = max(own_after - own, stall_after - stall)
                self.last_where = sampler.samples.most_common(3)
                self.last_gc = sampler.gc_seconds - collecting

        return timed

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not (message.startswith("Executing ") and " took " in message):
            return
        took = record.args[-1] if isinstance(record.args, tuple) else None
        if not isinstance(took, float):
            self.reports.append(message)
            return
        # A callback that spent most of its time waiting for a CPU says nothing measurable
        # about itself: the two clocks are read at different instants.
        if took - self.last_wait >= self.threshold and self.last_wait < took / 2:
            where = "; ".join(f"{n} x {PERIOD_MS} ms at {at}" for at, n in self.last_where)
            self.reports.append(
                f"{message} ({self.last_wait * 1000:.0f} ms waiting for a CPU; "
                f"{self.last_gc * 1000:.0f} ms in gc; sampled: {where or 'nothing'})"
            )


def _no_checkcache(filename: str | None = None) -> None:
    """linecache.checkcache while the loop watch runs: nothing to re-check."""


PERIOD_MS = round(_Sampler.PERIOD * 1000)

DEFAULT_THREADS = 8
"""Threads of the default executor a watched test's loop gets, all started before the watch."""


@pytest.fixture
async def loop_watch(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """The test's event loop in asyncio debug mode; the test fails if anything (the box's
    start and close included) held the loop longer than :data:`SLOW_CALLBACK_SECS`."""
    loop = asyncio.get_running_loop()
    # The loop's default executor (asyncio.to_thread in tests) with its threads started now,
    # before the watch: a thread started on demand is started by the loop, which then waits
    # for it to run, over 20 ms on a busy host, and that wait is no CPU wait of the loop's.
    threads = concurrent.futures.ThreadPoolExecutor(DEFAULT_THREADS, "test-default")
    together = threading.Barrier(DEFAULT_THREADS + 1)
    for _ in range(DEFAULT_THREADS):
        threads.submit(together.wait, 30)
    together.wait(30)
    loop.set_default_executor(threads)
    # What earlier tests left on the heap is the test session's, not the box's: a full
    # collection of it (over 50 ms late in a 2,000-test session) would land in some step of
    # this test. Frozen, collections here scan only what this test makes.
    gc.freeze()
    # Debug mode records where every future was made: Python 3.11's C futures call
    # traceback.extract_stack() on the whole stack (pytest's is ~80 frames), each frame's
    # source file stat'ed and its line looked up. A step that made ~200 futures spent 20-100
    # ms in that bookkeeping, the harness's cost, not the code's under test. asyncio's own
    # records keep 10 frames (constants.DEBUG_STACK_DEPTH); so do these, without the stat.
    monkeypatch.setattr(sys, "tracebacklimit", 10, raising=False)
    monkeypatch.setattr(linecache, "checkcache", _no_checkcache)
    handler = _SlowCallbacks(SLOW_CALLBACK_SECS)
    monkeypatch.setattr(asyncio.Handle, "_run", handler.track(asyncio.Handle._run))
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    debug, threshold = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW_CALLBACK_SECS
    try:
        yield
    finally:
        loop.set_debug(debug)
        loop.slow_callback_duration = threshold
        logger.removeHandler(handler)
        handler.sampler.close()
        gc.unfreeze()
    if handler.reports:
        limit = f"{SLOW_CALLBACK_SECS * 1000:g} ms"
        pytest.fail(f"the event loop was held over {limit}: " + "; ".join(handler.reports))


@pytest.fixture
def box_policy(backend_name: str, loop_watch: None) -> Policy:
    """The default policy on the backend under test (build variants with model_copy). Its
    tests run with :func:`loop_watch`: nothing may block the event loop."""
    return backend_policy(backend_name)


@pytest.fixture
async def sandbox(box_policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    async with Sandbox(box_policy, workspace=workspace) as sb:
        yield sb


@pytest.fixture
def sessions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private directory for the attach server's socket (used by the PTY tests)."""
    path = tmp_path / "sessions"
    monkeypatch.setenv("CORRAL_SESSIONS_DIR", str(path))
    return path


@pytest.fixture
async def sh(sandbox: Sandbox) -> AsyncIterator[PtySession]:
    """A shell session in the test's box, at its first prompt."""
    session = await sandbox.shell()
    assert (await session.expect(PROMPT, 10)).matched
    yield session
    await session.close()


def dead_pid() -> int:
    """A pid that is certainly not running: a child this process started and reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
