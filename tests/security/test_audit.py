"""The audit log: commands, tool calls, approval decisions, denied file operations and
violations (seccomp kill, OOM, pids limit) land in ``policy.audit_log``; ``corral audit``
shows it, ``--follow`` tails it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from corral import PathOutsideSandbox, Policy, Sandbox
from corral.audit import AuditLog, read_records
from corral.cli import main
from corral.sandbox import STDIN_CHUNK
from corral.tools import Rule, Toolbox
from corral.tools.approvals import ApprovalRequest
from security.helpers import rlimits_only

pytestmark = [pytest.mark.needs_bwrap]


def audited(policy: Policy, log: Path, **limits: Any) -> Policy:
    update: dict[str, Any] = {"audit_log": log}
    if limits:
        update["limits"] = policy.limits.model_copy(update=limits)
    return policy.model_copy(update=update)


def of_kind(log: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records(log) if r["kind"] == kind]


async def test_commands_are_recorded(box_policy: Policy, workspace: Path, tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    async with Sandbox(audited(box_policy, log), workspace=workspace) as sb:
        r = await sb.run(["sh", "-c", "exit 3"])
        slow = await sb.run("sleep 5", timeout=0.2)
    assert r.exit_code == 3 and slow.timed_out
    cmds = of_kind(log, "command")
    spawn = next(c for c in cmds if c["event"] == "spawn" and c["pid"] == r.pid)
    assert spawn["argv"] == ["sh", "-c", "exit 3"] and spawn["cwd"] == "/workspace"
    exits = {c["pid"]: c for c in cmds if c["event"] == "exit"}
    assert exits[r.pid]["exit_code"] == 3 and exits[r.pid]["timed_out"] is False
    assert exits[r.pid]["duration"] >= 0
    assert exits[slow.pid]["timed_out"] is True
    events = [r["event"] for r in of_kind(log, "sandbox")]
    assert events == ["start", "close"]
    assert {rec["sandbox"] for rec in read_records(log)} == {sb.sandbox_id}


async def test_a_spawn_is_recorded_before_its_exit(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    # ``true`` with more stdin than one spawn frame carries: the command is gone before
    # the rest of its input is sent, so its exit is read before ``spawn`` returns.
    log = tmp_path / "audit.jsonl"
    async with Sandbox(audited(box_policy, log), workspace=workspace) as sb:
        pids = [(await sb.run("true", stdin=b"x" * (STDIN_CHUNK + 1))).pid]
        pids += [(await sb.run("true")).pid for _ in range(20)]
    order = [(c["pid"], c["event"]) for c in of_kind(log, "command")]
    for pid in pids:
        assert order.count((pid, "spawn")) == 1, order
        assert order.index((pid, "spawn")) < order.index((pid, "exit")), order


async def test_violations_are_recorded(box_policy: Policy, workspace: Path, tmp_path: Path) -> None:
    if box_policy.runtime == "runsc":
        pytest.skip(
            "gVisor: a memory overrun ends the whole box (its kernel is the cgroup's biggest "
            "process) and pids.max counts its kernel's threads, so no per-command oom or "
            "pids_limit violation exists to record"
        )
    log = tmp_path / "audit.jsonl"
    policy = audited(box_policy, log, memory_bytes=64 << 20, max_pids=16)
    async with Sandbox(policy, workspace=workspace) as sb:
        oom = await sb.run(["python3", "-c", "b = []\nwhile True: b.append(bytearray(8 << 20))"])
        # seccomp kills with SIGSYS (the attack suite's int 0x80 test); a process raising
        # SIGSYS at itself reads the same to the host.
        sys_kill = await sb.run(["python3", "-c", "import os; os.kill(os.getpid(), 31)"])
        bomb = await sb.run("b(){ b | b & }; b; while :; do :; done", timeout=1)
        by_rlimits = await rlimits_only(sb)
    if by_rlimits:  # rootless: RLIMIT_AS and RLIMIT_NPROC refuse; only seccomp kills
        assert "MemoryError" in oom.stderr and "Cannot fork" in bomb.stderr
        assert sys_kill.exit_code == -31
        assert "seccomp" in {v["type"] for v in of_kind(log, "violation")}
        return
    assert oom.oom_killed and bomb.pids_limited and sys_kill.exit_code == -31
    kinds = {v["type"] for v in of_kind(log, "violation")}
    assert {"oom", "pids_limit", "seccomp"} <= kinds
    exits = {c["pid"]: c for c in of_kind(log, "command") if c["event"] == "exit"}
    assert exits[oom.pid]["oom_killed"] is True


async def test_tool_calls_approvals_and_denied_files(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    asked: list[ApprovalRequest] = []

    async def approver(request: ApprovalRequest) -> bool:
        asked.append(request)
        return "yes" in (request.command_line or "")

    rules = [
        Rule(tool="run_command", command="yes", outcome="ask"),
        Rule(tool="run_command", command="no", outcome="ask"),
        Rule(tool="run_command", command="never", outcome="deny", reason="forbidden"),
    ]
    async with Sandbox(audited(box_policy, log), workspace=workspace) as sb:
        tools = Toolbox(sb, approver=approver, rules=rules)
        assert "error" not in await tools.call("run_command", {"command": "echo yes"})
        assert (await tools.call("run_command", {"command": "echo no"}))["error"]["code"]
        assert (await tools.call("run_command", {"command": "never"}))["error"]["code"]
        assert (await tools.call("vfs_read", {"path": "../../etc/passwd"}))["error"]["code"]
        await sb.run("ln -s /etc out")
        with pytest.raises(PathOutsideSandbox):
            await sb.files.read("out/hostname")
    decisions = [(a["decision"], a["command"]) for a in of_kind(log, "approval")]
    assert decisions == [
        ("approved", "echo yes"),
        ("declined", "echo no"),
        ("denied_by_policy", "never"),
    ]
    tool_records = of_kind(log, "tool")
    assert [t["tool"] for t in tool_records] == ["run_command"] * 3 + ["vfs_read"]
    assert tool_records[0]["error"] is None and tool_records[1]["error"] == "approval_denied"
    denied = of_kind(log, "file_denied")
    assert [d["path"] for d in denied] == ["../../etc/passwd", "/workspace/out/hostname"]


def test_cli_prints_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "audit.jsonl"
    audit = AuditLog(log, "cb-0123456789ab")
    audit.record("command", event="spawn", pid=7, argv=["sh", "-c", "ls -l"], cwd="/workspace")
    audit.record("violation", type="oom", count=1)
    audit.close()
    with log.open("a") as f:
        f.write("not json\n")
    assert main(["audit", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "cb-0123456789ab command spawn pid=7 argv='sh -c '\"'\"'ls -l'\"'\"''" in lines[0] or (
        "command spawn pid=7" in lines[0] and "cwd=/workspace" in lines[0]
    )
    assert "violation oom count=1" in lines[1]
    assert lines[2] == "? not json"
    assert main(["audit", "--json", str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith('{"ts":')


def test_cli_reads_the_policy_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "a.jsonl"
    AuditLog(log, "cb-x").record("sandbox", event="start")
    policy = tmp_path / "corral.toml"
    policy.write_text(f'audit_log = "{log}"\n')
    assert main(["audit", "--policy", str(policy)]) == 0
    assert "cb-x sandbox start" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "missing.jsonl")]) == 1


def test_cli_follow_tails_new_records(tmp_path: Path) -> None:
    log = tmp_path / "follow.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli", "audit", "--follow", str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        audit = AuditLog(log, "cb-follow")
        for i in range(3):
            audit.record("tool", tool=f"t{i}")
        audit.close()
        stdout = proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(stdout.readline() for _ in range(3)))
        reader.start()
        reader.join(timeout=15)
        assert not reader.is_alive(), "corral audit --follow printed nothing"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert [ln.split()[-1] for ln in lines] == ["tool=t0", "tool=t1", "tool=t2"]
