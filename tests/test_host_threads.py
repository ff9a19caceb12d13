"""The host thread pool (``corral.backends.host.threads``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from corral.backends.host import threads


class _ExitingPool(ThreadPoolExecutor):
    """A pool whose interpreter starts exiting after ``allowed`` jobs: then every submit
    fails as ``ThreadPoolExecutor.submit`` does after ``_python_exit``."""

    def __init__(self, allowed: int) -> None:
        super().__init__(threads.MAX_THREADS)
        self.allowed = allowed

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.allowed == 0:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        self.allowed -= 1
        return super().submit(fn, *args, **kwargs)


def test_threads_started_as_the_interpreter_exits_do_not_hold_its_exit() -> None:
    """A command that fails at once (``corral run`` refusing a policy in its first host job)
    exits while the pool's first thread is still starting the others. Those already started
    must not wait out the barrier's 10 s: the exit joins them (it took 10 s more)."""
    pool = _ExitingPool(allowed=4)  # _start_more itself, then three of its seven
    pool.submit(threads._start_more, pool)
    done = threading.Event()

    def close() -> None:
        pool.shutdown(wait=True)
        done.set()

    closer = threading.Thread(target=close)
    closer.start()
    assert done.wait(timeout=5), "the started threads still wait for the barrier"
    closer.join()
