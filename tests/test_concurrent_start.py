"""Boxes started together by a process whose backend is not found yet: the first starts race
to find it, and there must be one. A second BwrapBackend, dropped, took its spawner thread
with it, and bwrap's --die-with-parent follows the thread that started it: every box that
thread had started was SIGKILLed (9 of 10 boxes of ``asyncio.gather`` lost their agent)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from corral import Policy
from corral.backends.bwrap.box import BwrapBackend

pytestmark = pytest.mark.needs_bwrap

STARTS = """
import asyncio
from corral import Sandbox

async def main():
    boxes = [Sandbox() for _ in range(8)]
    await asyncio.gather(*(b.start() for b in boxes))
    try:
        runs = await asyncio.gather(*(b.run(["true"]) for b in boxes), return_exceptions=True)
    finally:
        await asyncio.gather(*(b.aclose() for b in boxes), return_exceptions=True)
    print([getattr(r, "exit_code", repr(r)) for r in runs])

asyncio.run(main())
"""


def test_boxes_started_together_first_thing_all_live() -> None:
    out = subprocess.run(
        [sys.executable, "-c", STARTS], capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == str([0] * 8), out.stdout + out.stderr


def test_threads_finding_the_backend_at_once_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BwrapBackend, "_found", None)
    ready = threading.Barrier(6)
    found: list[BwrapBackend] = []

    def find() -> None:
        ready.wait()
        found.append(BwrapBackend.for_policy(Policy()))

    threads = [threading.Thread(target=find) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(found) == 6 and len({id(b) for b in found}) == 1
