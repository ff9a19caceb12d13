"""The contract tests' event-loop watch (``conftest.loop_watch``) reports what it should."""

from __future__ import annotations

import asyncio
import logging
import time

from conftest import SLOW_CALLBACK_SECS, _SlowCallbacks


def _report(took: float) -> logging.LogRecord:
    # The record asyncio's debug mode logs for a slow callback (base_events._run_once).
    return logging.LogRecord(
        "asyncio", logging.WARNING, __file__, 1, "Executing %s took %.3f seconds",
        ("<Handle>", took), None,
    )  # fmt: skip


def test_a_callback_holding_the_loop_is_reported_less_the_time_spent_waiting_for_a_cpu() -> None:
    watch = _SlowCallbacks(0.020)
    watch.last_wait = 0.0
    watch.emit(_report(0.050))
    assert len(watch.reports) == 1
    watch.last_wait = 0.040  # the host was oversubscribed for most of that callback
    watch.emit(_report(0.050))
    assert len(watch.reports) == 1
    watch.emit(logging.LogRecord("asyncio", logging.WARNING, __file__, 1, "other", (), None))
    assert len(watch.reports) == 1


async def test_the_watch_sees_a_real_blocking_callback() -> None:
    loop = asyncio.get_running_loop()
    watch = _SlowCallbacks(0.0)  # every callback counts: no dependence on the host's load
    logger = logging.getLogger("asyncio")
    logger.addHandler(watch)
    debug, threshold = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = 0.005
    try:
        loop.call_soon(time.sleep, 0.01)  # blocks the loop: what the watch is for
        await asyncio.sleep(0.05)
    finally:
        loop.set_debug(debug)
        loop.slow_callback_duration = threshold
        logger.removeHandler(watch)
    assert any("sleep" in r for r in watch.reports), watch.reports
    assert SLOW_CALLBACK_SECS > 0
