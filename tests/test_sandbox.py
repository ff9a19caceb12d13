"""Commands in a real box: results, streams, stdin, cwd/env, timeouts, processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from corral import CommandFailed, Policy, ProcessNotFound, Sandbox, SpawnFailed, SyncSandbox
from corral.backends import effective_backend
from corral.errors import ErrorCode, SandboxError

pytestmark = pytest.mark.needs_bwrap


async def test_exit_code_and_both_streams(sandbox: Sandbox) -> None:
    r = await sandbox.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.timed_out and not r.truncated and not r.ok


async def test_argv_is_not_interpreted_by_a_shell(sandbox: Sandbox) -> None:
    r = await sandbox.run(["echo", "$HOME", "a;b"])
    assert r.stdout == "$HOME a;b\n"


async def test_stdin_is_delivered_and_closed(sandbox: Sandbox) -> None:
    r = await sandbox.run(["tr", "a-z", "A-Z"], stdin="hello\n")
    assert r.stdout == "HELLO\n"
    r = await sandbox.run(["cat"])  # no stdin: closed, so cat ends at once
    assert r.exit_code == 0 and r.stdout == ""


async def test_cwd_and_env(sandbox: Sandbox) -> None:
    await sandbox.files.mkdir("sub/dir")
    r = await sandbox.run("pwd; echo $FOO", cwd="sub/dir", env={"FOO": "bar"})
    assert r.stdout == "/workspace/sub/dir\nbar\n"


async def test_host_environment_does_not_leak(
    monkeypatch: pytest.MonkeyPatch, workspace: Path
) -> None:
    monkeypatch.setenv("CORRAL_TEST_SECRET", "hunter2")
    async with Sandbox(Policy.from_dict({"env": {"ALLOWED": "yes"}}), workspace=workspace) as sb:
        r = await sb.run("env")
    assert "hunter2" not in r.stdout
    assert "ALLOWED=yes" in r.stdout
    assert "HOME=/home/user" in r.stdout


async def test_timeout_kills_the_group_and_keeps_partial_output(sandbox: Sandbox) -> None:
    # A background grandchild in the same group must die with the command.
    r = await sandbox.run(
        "echo started; (sleep 30; touch survived) & echo $! > /workspace/child; sleep 30",
        timeout=0.5,
    )
    assert r.timed_out and r.exit_code == -15 and r.ended == "timed_out"  # the SIGTERM did
    assert r.stdout == "started\n"
    child = (await sandbox.files.read_text("child")).strip()
    gone = await sandbox.run(
        ["sh", "-c", f"kill -0 {child} 2>/dev/null && echo alive || echo gone"]
    )
    assert gone.stdout == "gone\n"


async def test_check_raises_with_the_result(sandbox: Sandbox) -> None:
    with pytest.raises(CommandFailed) as info:
        await sandbox.run("exit 2", check=True)
    assert info.value.code == ErrorCode.COMMAND_FAILED
    assert info.value.result.exit_code == 2  # type: ignore[attr-defined]


async def test_missing_program_is_a_result_with_127(sandbox: Sandbox) -> None:
    r = await sandbox.run(["no-such-program"])
    assert (r.exit_code, r.ended) == (127, "not_started")
    assert "no-such-program: command not found" in r.stderr
    with pytest.raises(SpawnFailed, match="no-such-program"):
        await sandbox.spawn(["no-such-program"])
    with pytest.raises(SpawnFailed, match="working directory"):
        await sandbox.run(["true"], cwd="does/not/exist")


async def test_empty_command_is_invalid_input(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxError) as info:
        await sandbox.run([])
    assert info.value.code == ErrorCode.INVALID_INPUT


async def test_background_process_wait_output_and_signal(sandbox: Sandbox) -> None:
    p = await sandbox.spawn("echo first; echo err >&2; exec sleep 30")
    assert p.status == "running"
    q = p.subscribe()
    async with asyncio.timeout(10):
        while "first" not in p.output("stdout") or "err" not in p.output("stderr"):
            await q.get()
    p.unsubscribe(q)
    assert p.output("stdout") == "first\n"
    assert p.output("stderr") == "err\n"
    waited = await p.wait(timeout=0.05)
    assert waited.status == "timeout"
    assert waited.message == "process still running after 50ms"
    stats = await p.stats()
    # gVisor's kernel reports a task blocked in nanosleep as "D" in /proc/<pid>/stat; in a
    # microVM the new program may still be paging itself in over 9p (uninterruptible).
    slow_d = sandbox.policy.runtime == "runsc" or sandbox.policy.backend == "microvm"
    asleep = {"sleeping", "running"} | ({"disk-sleep"} if slow_d else set())
    assert stats.status in asleep and stats.rss_bytes > 0
    assert await p.signal("SIGTERM")
    done = await p.wait(timeout=10)
    assert (done.status, done.exit_code) == ("exited", -15)
    assert "exited with status -15" in repr(p)


async def test_processes_are_tracked_and_looked_up(sandbox: Sandbox) -> None:
    r = await sandbox.run("true")
    infos = {i.pid: i for i in sandbox.processes()}
    assert infos[r.pid].status == "exited" and infos[r.pid].exit_code == 0
    assert sandbox.process(r.pid).pid == r.pid
    with pytest.raises(ProcessNotFound):
        sandbox.process(99999)


async def test_finished_processes_beyond_max_tracked_are_forgotten(workspace: Path) -> None:
    policy = Policy.from_dict({"process_tracking": {"max_tracked": 2}})
    async with Sandbox(policy, workspace=workspace) as sb:
        pids = [(await sb.run("true")).pid for _ in range(4)]
        assert [i.pid for i in sb.processes()] == pids[-2:]


async def test_pipe_stdin_writer(sandbox: Sandbox) -> None:
    p = await sandbox.spawn(["cat"], stdin="pipe")
    await p.write("line one\n")
    await p.write(b"line two\n", eof=True)
    assert (await p.wait(timeout=10)).exit_code == 0
    assert p.output() == "line one\nline two\n"


async def test_output_is_capped_keeping_head_and_tail(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"output_bytes": "64K"}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("echo HEAD; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo TAIL")
    assert r.truncated
    assert r.stdout.startswith("HEAD\n") and r.stdout.endswith("TAIL\n")
    assert "bytes truncated" in r.stdout
    assert len(r.stdout) < 70_000


async def test_info_reports_the_box(sandbox: Sandbox) -> None:
    info = await sandbox.info()
    assert info["hostname"] == "corral"
    assert info["kernel"].startswith("Linux")
    assert info["cpus"] >= 1 and info["memory_bytes"] > 0
    assert info["backend"] == effective_backend(sandbox.policy)  # bwrap-rootless for a user
    assert info["memory_limit_bytes"] == 1 << 30


async def test_operations_after_close_are_refused(workspace: Path) -> None:
    sb = Sandbox(workspace=workspace)
    await sb.start()
    await sb.aclose()
    await sb.aclose()  # idempotent
    with pytest.raises(SandboxError) as info:
        await sb.run("true")
    assert info.value.code == ErrorCode.SANDBOX_CLOSED


def test_sync_facade_runs_commands(workspace: Path) -> None:
    with SyncSandbox(workspace=workspace) as sb:
        assert sb.run("echo hi").stdout == "hi\n"
        p = sb.spawn(["sh", "-c", "exit 7"])
        assert p.wait(timeout=10).exit_code == 7
        assert sb.spawn("sleep 30").terminate(0.5).exit_code == -15
        sb.files.write("f.txt", "data")
        assert sb.files.read_text("f.txt") == "data"
    assert (workspace / "f.txt").read_text() == "data"


async def test_a_box_that_cannot_start_says_why(workspace: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    policy = Policy.from_dict({"filesystem": {"mounts": [{"host": str(missing), "guest": "/m"}]}})
    with pytest.raises(SandboxError) as info:
        async with Sandbox(policy, workspace=workspace):
            pass
    # Refused before any backend runs, naming the field and the path (it was bwrap's own
    # words, as backend_failed, and each backend's were different).
    assert info.value.code == ErrorCode.INVALID_POLICY
    assert "filesystem.mounts[0].host" in info.value.message
    assert str(missing) in info.value.message


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "10", True])
def test_a_bad_ready_timeout_is_refused_by_name(bad: object) -> None:
    with pytest.raises(SandboxError, match="ready_timeout") as info:
        Sandbox(ready_timeout=bad)  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.INVALID_INPUT


SYNC_INTERRUPTED = r"""
import glob, json, os, signal, sys, threading, time
import corral

ws = sys.argv[1]
mine = lambda: [p for p in glob.glob("/run/corral/boxes/*/owner.json")
                if json.load(open(p)).get("host_pid") == os.getpid()]

def interrupt_when(path):
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)  # the command in the box is up: the user's Ctrl-C now
    os.kill(os.getpid(), signal.SIGINT)

# 1. Ctrl-C during run(): the command ends (TERM, grace, KILL) before the interrupt goes on.
with corral.SyncSandbox(workspace=ws) as sb:
    threading.Thread(target=interrupt_when, args=(ws + "/started",)).start()
    try:
        sb.run("touch /workspace/started; sleep 30; touch /workspace/finished")
        print("run returned")
    except KeyboardInterrupt:
        left = [l for l in sb.run("ps -eo args").stdout.splitlines() if "sleep 30" in l]
        print("after run:", json.dumps(left))

# 2. Ctrl-C while a box starts: the start is undone, nothing of the box is left.
for delay in (0.002, 0.01, 0.03):
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with corral.SyncSandbox(workspace=ws) as sb:
            time.sleep(5)
    except KeyboardInterrupt:
        pass
    mounts = [l for l in open("/proc/self/mountinfo") if ws + " " in l]
    print("after start:", json.dumps([mine(), mounts]))
"""


def test_ctrl_c_in_the_sync_api_ends_what_it_interrupted(workspace: Path, tmp_path: Path) -> None:
    """An interrupt of a SyncSandbox call cancels the call in the loop's thread, as an async
    cancellation does: the command ended (it ran on to its end after the caller saw the
    interrupt), and a start undone (it left its box and the workspace's mount behind)."""
    import subprocess
    import sys

    script = tmp_path / "interrupted.py"
    script.write_text(SYNC_INTERRUPTED)
    out = subprocess.run(
        [sys.executable, str(script), str(workspace)], capture_output=True, timeout=120
    )
    lines = out.stdout.decode().splitlines()
    assert out.returncode == 0 and len(lines) == 4, (out.stdout, out.stderr)
    assert lines[0] == "after run: []", lines
    assert not (workspace / "finished").exists()
    assert all(line == "after start: [[], []]" for line in lines[1:]), lines
    assert b"Traceback" not in out.stderr and b"destroyed" not in out.stderr, out.stderr
