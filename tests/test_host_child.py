"""A backend's host-side child (``corral.backends.host.child``): started from a host thread,
its exit and its error output seen without asyncio's child watcher, and a start cancelled
while the thread was spawning leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from corral.backends.host.child import spawn


def _children() -> set[int]:
    """This process's children, zombies included (every thread's list)."""
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with (task / "children").open() as f:
            found.update(int(pid) for pid in f.read().split())
    return found


async def test_exit_status_and_error_output(loop_watch: None) -> None:
    child = await spawn(
        ["sh", "-c", "echo 'no such mount' >&2; exit 3"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert await child.wait() == 3 and child.returncode == 3
        assert await child.stderr() == "no such mount"
    finally:
        child.close()
    assert child.pid not in _children()  # reaped


async def test_a_cancelled_wait_leaves_the_child_waitable_and_kill_ends_it(
    loop_watch: None,
) -> None:
    child = await spawn(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await child.wait()
        assert child.returncode is None
        child.kill()
        assert await asyncio.wait_for(child.wait(), 10) == -9
        assert await child.stderr() == ""  # no pipe was asked for
    finally:
        child.close()


async def test_a_spawn_cancelled_while_popen_runs_leaves_no_process() -> None:
    """The spawn is cancelled while its thread is inside ``Popen`` (the child is forked and
    held before its exec): once ``Popen`` returns, the child is killed and reaped before the
    cancellation reaches the caller, not left running with nobody to wait for it."""
    loop = asyncio.get_running_loop()
    before = _children()
    in_popen_r, in_popen_w = os.pipe()
    go_r, go_w = os.pipe()

    def held() -> None:  # in the forked child, before its exec
        os.write(in_popen_w, b"1")
        os.read(go_r, 1)

    task = asyncio.ensure_future(spawn(["sleep", "60"], stdin=subprocess.DEVNULL, preexec_fn=held))
    try:
        assert await asyncio.wait_for(loop.run_in_executor(None, os.read, in_popen_r, 1), 10)
        task.cancel()
        os.write(go_w, b"1")  # Popen returns once the child has exec'd sleep
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert _children() - before == set()  # started, killed and reaped
    finally:
        for pid in _children() - before:
            os.kill(pid, signal.SIGKILL)
            await asyncio.to_thread(os.waitpid, pid, 0)
        for fd in (in_popen_r, in_popen_w, go_r, go_w):
            os.close(fd)
