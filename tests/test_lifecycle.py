"""Closing a box leaves nothing behind, also when its owner is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral import Policy, PolicyError, Sandbox, SandboxBroken
from corral.backends.base import BoxBase
from corral.backends.bwrap.box import sweep_orphans
from corral.backends.host import cgroups, idmap
from corral.backends.host.state import state_root

pytestmark = pytest.mark.needs_bwrap


def box_processes(sandbox_id: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if sandbox_id.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    support = cgroups.detect()
    roots = [Path(m) for m in support.mounts.values()] if support.mounts else [Path(support.root)]
    return [d for r in roots if (d := r / "corral" / sandbox_id).exists()]


def wait_pid_gone(pid: int, timeout: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


async def _fds_after_warm_up() -> int:
    """Open fds but the idmap namespace cache's (one per workspace owner and owner slot in
    use, not per box), once a first box has filled the other process-lifetime caches."""
    idmap.unsupported_reason()
    async with Sandbox() as sb:
        await sb.run("true")
    return _fds()


def _fds() -> int:
    cached = idmap.cached_namespace_fds()
    return len([fd for fd in os.listdir("/proc/self/fd") if int(fd) not in cached])


async def test_close_leaves_no_process_cgroup_state_or_workspace() -> None:
    fds_before = await _fds_after_warm_up()
    sb = Sandbox()
    await sb.start()
    sid = sb.sandbox_id
    ws = sb.workspace
    assert ws is not None and ws.exists()
    await sb.spawn("sleep 300 & sleep 300")
    await sb.spawn(["sh", "-c", "setsid sleep 300"])
    assert box_processes(sid) and cgroup_dirs(sid)
    await sb.aclose()
    assert box_processes(sid) == []
    assert cgroup_dirs(sid) == []
    assert not (state_root() / "boxes" / sid).exists()
    assert not ws.exists()
    assert _fds() == fds_before


async def test_many_boxes_open_and_close_without_leaking_fds() -> None:
    """Five boxes at once leave no fd behind (but the idmap namespace cache's: one per
    owner slot in use, slots lowest first)."""

    async def five() -> None:
        boxes = [Sandbox() for _ in range(5)]
        await asyncio.gather(*(b.start() for b in boxes))
        results = await asyncio.gather(*(b.run("echo $$") for b in boxes))
        assert all(r.exit_code == 0 for r in results)
        await asyncio.gather(*(b.aclose() for b in boxes))

    fds_before = await _fds_after_warm_up()
    await five()
    assert _fds() == fds_before


SCRIPT = """
import asyncio, json, sys
from corral import Sandbox

async def main():
    sb = Sandbox()
    await sb.start()
    await sb.spawn("sleep 300")
    owner = (sb._box._spec.state_dir / "owner.json").read_text()
    print(json.dumps({"id": sb.sandbox_id, "owner": json.loads(owner)}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_sigkill_of_the_owner_leaves_nothing_after_the_next_sweep() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline()
    info = json.loads(line)
    sid, bwrap_pid = info["id"], info["owner"]["bwrap_pid"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    # bwrap dies with its parent (--die-with-parent), and the box's PID namespace with it.
    assert wait_pid_gone(bwrap_pid, 10)
    removed = sweep_orphans()
    assert sid in removed
    assert box_processes(sid) == []
    assert cgroup_dirs(sid) == []
    assert not (state_root() / "boxes" / sid).exists()


async def test_a_killed_agent_breaks_the_sandbox_cleanly(sandbox: Sandbox) -> None:
    if sandbox.policy.backend != "bwrap":
        pytest.skip("kills the bwrap process; tests/test_oci.py kills an OCI box's agent")
    p = await sandbox.spawn("sleep 300")
    assert sandbox._box is not None
    bwrap_pid = sandbox._box._proc.pid  # type: ignore[attr-defined]
    os.kill(bwrap_pid, signal.SIGKILL)
    result = await p.wait(timeout=10)
    assert result.status == "exited" and result.exit_code == -9
    with pytest.raises(SandboxBroken):
        await sandbox.run("true")


async def test_a_hung_box_is_killed_and_every_call_says_so(
    box_policy: Policy, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP freezes the box from the host (its agent, or the whole VM): the heartbeat
    notices, kills the box, and the pending call fails with the reason instead of hanging."""
    import corral.sandbox

    monkeypatch.setattr(corral.sandbox, "HEARTBEAT_EVERY", 0.05)
    monkeypatch.setattr(BoxBase, "heartbeat_timeout", 3.0)  # every ping of this box
    async with Sandbox(box_policy, workspace=workspace) as sandbox:
        p = await sandbox.spawn("sleep 300")
        frozen = box_processes(sandbox.sandbox_id)
        assert frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises(SandboxBroken, match="stopped answering"):
            async with asyncio.timeout(30):
                await sandbox.run(["echo", "never"])
        result = await p.wait(timeout=10)
        assert result.status == "exited" and result.exit_code == -9  # lost with its box
        assert sandbox._heartbeat is not None
        async with asyncio.timeout(30):
            await sandbox._heartbeat  # it kills the box after failing the calls
        survivors = [pid for pid in frozen if process_state(pid) not in ("Z", "X", None)]
        assert not survivors, survivors
        with pytest.raises(SandboxBroken, match="stopped answering"):
            await sandbox.files.read_text("anything")


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


async def test_a_start_that_fails_leaves_no_state_dir(workspace: Path) -> None:
    """The network's directory is made before the box: a refused box must not leave it."""
    policy = Policy.from_dict(
        {
            "network": {"mode": "allowlist", "allow_hosts": ["x.test"]},
            "filesystem": {"mounts": [{"host": "/tmp", "guest": "/usr/x/y"}]},
        }
    )
    sb = Sandbox(policy, workspace=workspace)
    with pytest.raises(PolicyError):
        await sb.start()
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


def test_the_sweep_removes_an_ownerless_box_dir_once_it_is_a_minute_old() -> None:
    boxes = state_root() / "boxes"
    old, young = boxes / "cb-ownerless-old", boxes / "cb-ownerless-young"
    for entry in (old, young):
        entry.mkdir(parents=True, exist_ok=True)
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    try:
        removed = sweep_orphans()
        assert old.name in removed and not old.exists()
        assert young.exists()  # may be a box another process is starting right now
    finally:
        for entry in (old, young):
            with contextlib.suppress(OSError):
                entry.rmdir()


def test_sweep_leaves_cgroups_that_are_not_boxes_alone() -> None:
    # Another process's group under corral/ (a test, another tool) must survive our sweep.
    group = cgroups.Cgroup.create("not-a-box-sweep-test", cgroups.CgroupLimits(max_pids=8))
    try:
        sweep_orphans()
        assert group.path.exists()
    finally:
        group.remove()
