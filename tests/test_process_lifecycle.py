"""Ending a command like trio: SIGTERM to its group, a grace, SIGKILL, then the reap.

Timeouts and cancellations both end a command that way, on every backend, and what is left in
the box afterwards is checked from inside the box.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, PolicyError, Sandbox, SandboxError
from corral.backends.host.state import state_root
from corral.errors import ErrorCode
from corral.streaming import Stdout

GRACE = 0.5

# A command that logs the SIGTERM it gets and goes on; its foreground sleep dies of the
# signal (same group), the loop starts another. Only a SIGKILL ends it.
STUBBORN = (
    "trap 'echo TERM >> /workspace/order' TERM; echo $$ > /workspace/pid; "
    "(sleep 301; echo survived >> /workspace/order) & "
    "while :; do sleep 1; done"
)

# Lists the processes of the box whose command line holds "sleep 301" (without holding it).
LEFT_OVER = (
    "import os\n"
    "mark = b'sleep' + b' 301'\n"
    "left = []\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        line = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ')\n"
    "        if p.isdigit() and mark in line:\n"
    "            left.append(p)\n"
    "    except OSError:\n"
    "        pass\n"
    "print(len(left))\n"
)


@pytest.fixture
async def box(box_policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": GRACE})
    async with Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace) as sb:
        yield sb


async def left_over(sb: Sandbox) -> int:
    r = await sb.run(["python3", "-I", "-c", LEFT_OVER], timeout=30)
    assert r.exit_code == 0, r.stderr
    return int(r.stdout)


async def wait_for_file(sb: Sandbox, path: str) -> None:
    """Until the command has written ``path`` (its trap is set by then)."""
    r = await sb.run(["sh", "-c", f"while [ ! -s {path} ]; do sleep 0.01; done"], timeout=30)
    assert r.exit_code == 0


async def test_a_timeout_sends_term_then_kill_after_the_grace(box: Sandbox) -> None:
    r = await box.run(["sh", "-c", STUBBORN], timeout=0.5)
    assert (r.timed_out, r.ended, r.timeout) == (True, "timed_out", 0.5)
    assert r.exit_code == -9  # it trapped the SIGTERM: the SIGKILL ended it
    assert r.duration >= 0.5 + GRACE  # the SIGKILL waited for the grace
    assert await box.files.read_text("order") == "TERM\n"  # no grandchild outlived it
    assert await left_over(box) == 0


async def test_a_command_that_honours_term_is_not_killed(box: Sandbox) -> None:
    r = await box.run("sleep 30", timeout=0.2)
    assert (r.exit_code, r.ended) == (-15, "timed_out")


async def test_a_cancelled_run_leaves_nothing_in_the_box(box: Sandbox) -> None:
    run = asyncio.create_task(box.run(["sh", "-c", STUBBORN]))
    await wait_for_file(box, "/workspace/pid")
    assert await left_over(box) >= 2  # the command and its grandchild: the probe sees them
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    # The cancellation returned after the TERM, the grace and the KILL: nothing is left.
    assert await left_over(box) == 0
    assert await box.files.read_text("order") == "TERM\n"
    [proc] = [p for p in box.registry.list() if "sleep 301" in p.command]
    assert (proc.exit_code, proc.ended) == (-9, "signalled")


async def test_a_run_under_an_asyncio_timeout_leaves_nothing(box: Sandbox) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1):
            await box.run("(sleep 301 &); sleep 301")
    assert await left_over(box) == 0


async def test_a_cancelled_wait_ends_its_process(box: Sandbox) -> None:
    proc = await box.spawn(["sh", "-c", STUBBORN])
    await wait_for_file(box, "/workspace/pid")
    waiter = asyncio.create_task(proc.wait())
    await asyncio.sleep(0)  # the waiter is waiting
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert proc.exit_code == -9
    assert await left_over(box) == 0


async def test_a_wait_with_a_timeout_leaves_the_process_running(box: Sandbox) -> None:
    proc = await box.spawn("sleep 30")
    assert (await proc.wait(0.1)).status == "timeout"
    assert proc.exit_code is None
    result = await proc.terminate()
    assert (result.status, result.exit_code, proc.ended) == ("exited", -15, "signalled")


async def test_terminate_of_an_exited_process_returns_its_status(box: Sandbox) -> None:
    proc = await box.spawn("exit 3")
    await proc.wait()
    assert (await proc.terminate()).exit_code == 3
    assert proc.ended == "exited"


async def test_the_result_reports_the_effective_timeout_and_the_ending(
    box_policy: Policy, workspace: Path
) -> None:
    limits = box_policy.limits.model_copy(update={"exec_timeout_secs": 30.0})
    async with Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace) as sb:
        r = await sb.run("exit 3")
        assert (r.exit_code, r.ended, r.timeout, r.timed_out) == (3, "exited", 30.0, False)
        r = await sb.run("kill -USR1 $$", timeout=5)
        assert (r.exit_code, r.ended, r.timeout) == (-10, "signalled", 5)
        assert r.to_dict()["ended"] == "signalled"
    async with Sandbox(box_policy, workspace=workspace) as sb:
        assert (await sb.run("true")).timeout is None


async def test_a_bad_timeout_is_refused_before_anything_starts(box: Sandbox) -> None:
    for bad in ("5", -1, 0, float("nan"), float("inf"), True):
        with pytest.raises(SandboxError, match="timeout must be a number of seconds") as info:
            await box.run("touch /tmp/started", timeout=bad)  # type: ignore[arg-type]
        assert info.value.code is ErrorCode.INVALID_INPUT
        with pytest.raises(SandboxError, match="timeout must be"):
            box.exec_stream("touch /tmp/started", timeout=bad)  # type: ignore[arg-type]
    assert (await box.run("test -e /tmp/started")).exit_code == 1  # nothing ran
    proc = await box.spawn("sleep 30")
    assert (await proc.wait(0)).status == "timeout"  # 0 or less: a look, as before
    with pytest.raises(SandboxError, match="timeout must be a number of seconds, or None"):
        await proc.wait("1")  # type: ignore[arg-type]
    await proc.terminate(grace=0)


@pytest.mark.parametrize("grace", [-1, "soon", 301])
def test_the_grace_is_validated_and_named(grace: object) -> None:
    with pytest.raises(PolicyError, match="kill_grace_secs"):
        Policy.from_dict({"limits": {"kill_grace_secs": grace}})


# ---- leaving early: the stream's block, a shell's close, the sandbox's close ----------------


async def test_leaving_a_stream_early_sends_term_then_kill_after_the_grace(box: Sandbox) -> None:
    loop = asyncio.get_running_loop()
    async with box.exec_stream(["sh", "-c", STUBBORN]) as stream:
        await wait_for_file(box, "/workspace/pid")
        left = loop.time()
    assert loop.time() - left >= GRACE  # the SIGKILL waited for the grace
    assert (stream.exit_code, stream.process.ended) == (-9, "signalled")
    assert await box.files.read_text("order") == "TERM\n"
    assert await left_over(box) == 0


async def test_leaving_a_stream_early_lets_a_command_end_on_term(box: Sandbox) -> None:
    async with box.exec_stream(["sleep", "30"]) as stream:
        pass
    assert stream.exit_code == -15


async def test_closing_a_shell_terms_its_job_then_kills_after_the_grace(box: Sandbox) -> None:
    sh = await box.shell()
    # A job that ignores the hang-up and logs the SIGTERM: only the SIGKILL ends it.
    await sh.write("sh -c \"trap '' HUP; " + STUBBORN.replace('"', '\\"') + '"\n')
    await wait_for_file(box, "/workspace/pid")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await sh.close(2.0)  # the trap has time to run on a busy host
    assert loop.time() - started >= 2.0
    assert await box.files.read_text("order") == "TERM\n"
    assert await left_over(box) == 0


async def test_closing_an_idle_shell_does_not_wait_for_the_grace(
    box_policy: Policy, workspace: Path
) -> None:
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": 30.0})
    async with Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace) as sb:
        sh = await sb.shell()
        async with asyncio.timeout(10):  # the hang-up ends the shell; no 30 s grace
            await sh.close()
            await sb.aclose()  # no shell left: nothing to wait for either


async def test_closing_the_sandbox_terms_everything_with_one_grace_for_all(
    box_policy: Policy, workspace: Path
) -> None:
    grace, count = 1.0, 5
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": grace})
    sb = Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace)
    await sb.start()
    try:
        procs = [
            await sb.spawn(["sh", "-c", STUBBORN.replace("/workspace/pid", f"/workspace/pid{n}")])
            for n in range(count)
        ]
        shell = await sb.shell()  # an idle shell ignores SIGTERM; the hang-up ends it
        for n in range(count):
            await wait_for_file(sb, f"/workspace/pid{n}")
    finally:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await sb.aclose()
    took = loop.time() - started
    ended = [p.exit_code for p in procs], shell.exit_code
    assert grace <= took < grace + 2.5, ended  # one grace for all five, not five in a row
    assert (workspace / "order").read_text() == "TERM\n" * count
    assert [(p.exit_code, p.ended) for p in procs] == [(-9, "signalled")] * count
    assert shell.exit_code is not None and shell.exit_code != -9


async def test_commands_do_not_inherit_signals_the_host_ignored(
    box_policy: Policy, workspace: Path
) -> None:
    """Started under ``nohup`` or as a shell's ``cmd &``, the host process ignores SIGHUP or
    SIGINT; a command in the box still gets the default action (a shell ends on its hang-up)."""
    ignored = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    try:
        sb = Sandbox(box_policy, workspace=workspace)
        await sb.start()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    async with sb:
        r = await sb.run("grep SigIgn /proc/self/status")
        assert int(r.stdout.split()[1], 16) & sum(1 << (s - 1) for s in ignored) == 0


async def test_a_close_cancelled_in_the_grace_still_tears_the_box_down(
    box_policy: Policy, workspace: Path
) -> None:
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": 60.0})
    sb = Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace)
    await sb.start()
    proc = await sb.spawn(["sh", "-c", "trap 'echo TERM' TERM; echo up; while :; do sleep 1; done"])
    events = proc.subscribe()
    seen = [proc.output_bytes("stdout")]  # what came before the subscription

    async def said(word: bytes) -> None:
        while word not in b"".join(seen):
            _, data = await events.get()
            seen.append(data if isinstance(data, bytes) else b"")

    async with asyncio.timeout(30):
        await said(b"up")  # its trap is set
        closing = asyncio.create_task(sb.aclose())
        await said(b"TERM")  # the close is in its grace
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert proc.exit_code is not None  # killed with the box, not left for 60 s
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


@pytest.mark.parametrize("turns", [1, 3, 10, 30, 100])
async def test_a_close_cancelled_anywhere_finishes_its_teardown_first(
    box_policy: Policy, workspace: Path, turns: int
) -> None:
    """Cancelled past its grace (in the shutdown, the box's or the workspace's teardown),
    a close still removes everything before the cancellation goes through: cut there, it
    left the workspace's idmapped mount, the cgroups and the state behind, for good."""
    sb = Sandbox(box_policy, workspace=workspace)
    await sb.start()
    closing = asyncio.create_task(sb.aclose())
    for _ in range(turns):  # the cancel lands that many turns of the loop into the close
        await asyncio.sleep(0)
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    assert [m for m in mounts if sb.sandbox_id in m] == []
    assert list(Path("/sys/fs/cgroup").glob(f"*/*/{sb.sandbox_id}*")) == []
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


async def test_a_box_that_dies_in_the_grace_ends_the_close_at_once(
    box_policy: Policy, workspace: Path
) -> None:
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": 60.0})
    sb = Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace)
    await sb.start()
    proc = await sb.spawn(["sh", "-c", "trap 'echo TERM' TERM; echo up; while :; do sleep 1; done"])
    events = proc.subscribe()
    seen = [proc.output_bytes("stdout")]

    async def said(word: bytes) -> None:
        while word not in b"".join(seen):
            _, data = await events.get()
            seen.append(data if isinstance(data, bytes) else b"")

    async with asyncio.timeout(30):  # not the 60 s grace: the box's death ends the wait
        await said(b"up")
        closing = asyncio.create_task(sb.aclose())
        await said(b"TERM")
        sb.stop()  # the box dies (as a crash would) while the close waits out the grace
        await closing
    assert proc.ended == "lost"
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


async def test_a_cancelled_request_does_not_break_the_box(box: Sandbox) -> None:
    # The agent answers a request whose caller has gone (an HTTP client that hung up, an
    # asyncio timeout): the late reply is dropped, not taken for a protocol violation.
    channel = box._channel
    assert channel is not None
    late = 0  # cancels whose reply was still to come (it may also beat the cancel)
    for _ in range(40):
        task = asyncio.ensure_future(box.info())
        for _ in range(50):  # the few loop steps until the request is on the wire
            if channel._pending:
                break
            await asyncio.sleep(0)
        assert channel._pending, "the request was never sent"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        late += bool(channel._abandoned)
        r = await box.run("echo still-here")
        assert (r.exit_code, r.stdout) == (0, "still-here\n")
        assert not channel._abandoned  # came, and was dropped
        if late >= 3:
            break
    assert late, "no reply came after its cancel: the case was never tried"


SLEEPERS = (  # live ones: a killed one waits as a zombie (no cmdline) until init reaps it
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
    " | grep -c '^sleep 30[012] $' || true"
)


async def test_a_timeout_ends_children_that_left_the_command_s_group(box: Sandbox) -> None:
    # `setsid` (a daemon, a test runner's workers) takes a child out of the command's group:
    # it is still the command's, and a timeout leaves nothing of it in the box.
    script = "setsid sleep 300 & setsid sh -c 'trap \"\" TERM; sleep 301' & echo up; sleep 302"
    r = await box.run(script, timeout=1)
    assert r.timed_out and r.stdout == "up\n"
    assert (await box.run(SLEEPERS)).stdout == "0\n"
    # "up" once both children have taken their own sessions (exec'd their sleep): left at
    # once, before that, a child between fork and setsid is in no group the walk can find.
    settled = "while [ $(cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n'"
    settled += " | grep -c '^30[01]$') -lt 2 ]; do :; done; "
    script = script.replace("echo up", settled + "echo up")
    async with box.exec_stream(script) as stream:  # and leaving a stream (terminate) the same
        async for event in stream:
            assert event == Stdout(b"up\n")  # its children are started
            break
    assert stream.process.ended == "signalled"
    assert (await box.run(SLEEPERS)).stdout == "0\n"


async def test_no_grace_sends_sigkill_alone(box_policy: Policy, workspace: Path) -> None:
    """``kill_grace_secs = 0`` is SIGKILL at once, alone: a SIGTERM first let the command's
    TERM handler run (and exit 0) before the KILL of the next tick."""
    limits = box_policy.limits.model_copy(update={"kill_grace_secs": 0.0})
    async with Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace) as sb:
        trapped = (
            "trap 'echo TERM >> /tmp/seen; exit 0' TERM; echo up; while :; do sleep 0.01; done"
        )
        for _ in range(3):
            r = await sb.run(["sh", "-c", trapped], timeout=0.3)
            assert (r.exit_code, r.ended) == (-9, "timed_out"), r
        proc = await sb.spawn(["sh", "-c", trapped])
        waited = await proc.terminate()
        assert waited.exit_code == -9, waited
        assert (await sb.run("cat /tmp/seen")).stdout == ""
