"""Blocking host work off the event loop: one thread pool for every backend and loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

MAX_THREADS = 8
STARTED_THREADS = MAX_THREADS
"""Threads started together, by the pool's first thread rather than the event loop: a thread
the pool starts on demand is started by the loop, which then waits for it to run (70 ms on a
busy host, measured with eight concurrent OCI starts)."""

_threads: ThreadPoolExecutor | None = None
_threads_lock = threading.Lock()


def _host_threads() -> ThreadPoolExecutor:
    """The threads every backend's blocking host work runs in, shared by all event loops of
    the process. Starting a thread waits until it runs, which held a busy host's loop for
    over 20 ms: a loop's own default executor starts its threads anew (one wait per thread,
    per loop); this pool is started once, and its first thread starts the others."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="corral-host")
            _threads.submit(_start_more, _threads)
        return _threads


def _start_more(pool: ThreadPoolExecutor) -> None:
    """Run by the pool's first thread: occupy :data:`STARTED_THREADS` threads at once, so the
    pool starts them here (it starts one per job while none is idle)."""
    together = threading.Barrier(STARTED_THREADS)
    try:
        for _ in range(STARTED_THREADS - 1):
            pool.submit(_meet, together)
    except RuntimeError:
        # The interpreter is exiting (a command that failed at once): no thread can start
        # now, so release those that did rather than keep its exit waiting for the barrier.
        together.abort()
        return
    _meet(together)


def _meet(together: threading.Barrier) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):
        together.wait(timeout=10)


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, off the event loop (cgroup v1 writes, umounts and other
    syscalls that wait for an RCU grace period). A cancellation waits for ``fn`` to return
    before it goes on, so the caller's cleanup sees everything ``fn`` did."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    done = asyncio.get_running_loop().run_in_executor(_host_threads(), call)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.wait({done})
        raise


def submit(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """``fn(*args)`` in a thread, submitted now, from any thread: for work that must start
    before the caller's next step (an RCU grace period meant to pass meanwhile). Wait for it
    (``asyncio.wrap_future``), also on failure, so that no thread outlives the caller."""
    return _host_threads().submit(contextvars.copy_context().run, fn, *args)


def in_new_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """``fn(*args)`` in a thread of its own, started now: for short blocking work that must
    not queue behind the shared threads (a start's prepare step waits for it to begin, and
    with every shared thread busy preparing starts it would wait in vain). Wait for the
    future, also on failure, so that no thread outlives the caller."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    call = functools.partial(contextvars.copy_context().run, fn, *args)

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(call())
        except BaseException as exc:  # handed to whoever waits for it
            done.set_exception(exc)

    threading.Thread(target=run, name="corral-prime", daemon=True).start()
    return done
