"""Pause and resume: a box's processes stop where they stand (the cgroup freezer) and go on
after; requests meanwhile are refused by name; a paused box still closes cleanly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import BackendUnavailable, Policy, Sandbox, SandboxPaused

pytestmark = pytest.mark.needs_bwrap

LOOP = "i=0; while :; do i=$((i+1)); echo $i > count.tmp && mv count.tmp count; done"


def _count(workspace: Path) -> int:
    try:
        return int((workspace / "count").read_text() or 0)
    except (OSError, ValueError):
        return 0


async def _advancing(workspace: Path, timeout: float = 30.0) -> int:
    first = _count(workspace)
    deadline = time.monotonic() + timeout
    while (now := _count(workspace)) <= first:
        assert time.monotonic() < deadline, "the loop does not advance"
        await asyncio.sleep(0.02)  # polling a file the box writes
    return now


async def test_pause_stops_the_box_and_resume_goes_on(workspace: Path) -> None:
    async with Sandbox(workspace=workspace) as sb:
        proc = await sb.spawn(LOOP)
        await _advancing(workspace)
        await sb.pause()
        assert sb.paused
        held = _count(workspace)
        await asyncio.sleep(0.5)  # nothing may happen in it: there is no event to wait for
        assert _count(workspace) == held
        with pytest.raises(SandboxPaused, match="resume"):
            await sb.run("true")
        await sb.resume()
        assert await _advancing(workspace) > held
        assert (await sb.run("echo back")).stdout == "back\n"
        await proc.kill()


async def test_pause_holds_while_processes_fork_and_exec(workspace: Path) -> None:
    """Freezing a box whose processes fork and exec all the time: cgroup v1 leaves a group
    in FREEZING while a task sits in a fork or exec it cannot be stopped in, and tries it
    again only when FROZEN is written again (the pause re-writes it while it waits). Ten
    pauses in a row, each must stop everything, each resume must let it go on."""
    async with Sandbox(workspace=workspace) as sb:
        churn = [await sb.spawn(f"while :; do /bin/true; sh -c : ; done # {i}") for i in range(4)]
        proc = await sb.spawn(LOOP)
        for _ in range(10):
            await _advancing(workspace)
            await sb.pause()
            held = _count(workspace)
            await asyncio.sleep(0.05)  # nothing may happen in it: there is no event to wait for
            assert _count(workspace) == held
            await sb.resume()
        for p in (*churn, proc):
            await p.kill()


async def test_a_paused_box_closes_and_leaves_nothing(workspace: Path) -> None:
    sb = Sandbox(workspace=workspace)
    await sb.start()
    await sb.spawn(LOOP)
    await _advancing(workspace)
    await sb.pause()
    await asyncio.wait_for(sb.aclose(), 30)
    held = _count(workspace)
    await asyncio.sleep(0.3)
    assert _count(workspace) == held  # the loop is gone, not thawed and running


async def test_oci_boxes_pause_through_the_runtimes_cgroup(workspace: Path) -> None:
    async with Sandbox(backend_policy("oci-crun"), workspace=workspace) as sb:
        await sb.spawn(LOOP)
        await _advancing(workspace)
        await sb.pause()
        held = _count(workspace)
        await asyncio.sleep(0.3)
        assert _count(workspace) == held  # frozen where it stood
        await sb.resume()
        await _advancing(workspace)


async def test_backends_without_a_freezer_say_so() -> None:
    """A box with no cgroup of its own (the microVM's, a rootless box without a delegated
    subtree) cannot pause: BackendUnavailable saying what it needs. (Every backend root runs
    here has a freezer, and the microVM takes seconds to start: the base class's answer.)"""
    from types import SimpleNamespace

    from corral.backends.base import BoxBase

    box = BoxBase.__new__(BoxBase)
    box._spec = SimpleNamespace(policy=Policy(backend="microvm"))  # type: ignore[assignment]
    with pytest.raises(BackendUnavailable, match="pausing a box is not available on the micro"):
        await box.freeze(True)


async def test_pause_and_resume_through_the_server(tmp_path: Path) -> None:
    import corral
    from served import serving

    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        async with corral.connect(served.url) as remote, remote.Sandbox() as sb:
            await sb.pause()
            assert (await sb.describe())["state"] == "paused"
            with pytest.raises(SandboxPaused):
                await sb.run("true")
            await sb.resume()
            assert (await sb.run("echo on")).stdout == "on\n"
