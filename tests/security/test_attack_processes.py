"""Process escapes: seeing or signalling host processes and the agent, leaving the cgroup,
outliving the sandbox (double fork, setsid, ignored signals), starving the host scheduler."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ONE_ID, one_id_skip
from corral import Policy, Sandbox
from security.helpers import box_py, gvisor, host_pids_mentioning

pytestmark = [pytest.mark.attack("processes"), pytest.mark.needs_bwrap]


@pytest.fixture
def host_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A host process with a unique marker in its command line."""
    marker = f"corral-host-{secrets.token_hex(4)}"
    proc = subprocess.Popen(["sh", "-c", f"read x # {marker}"], stdin=subprocess.PIPE)
    yield proc, marker
    proc.kill()
    proc.wait(timeout=5)
    if proc.stdin is not None:
        proc.stdin.close()


async def test_host_processes_are_invisible(
    sandbox: Sandbox, host_process: tuple[subprocess.Popen[bytes], str]
) -> None:
    proc, marker = host_process
    code = (
        "res = []\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n"
        f"            if {marker.encode()!r} in open(f'/proc/{{p}}/cmdline', 'rb').read():\n"
        "                res.append(p)\n"
        "        except OSError:\n"
        "            pass\n"
        f"res = [res, err(os.kill, {proc.pid}, 0)]"
    )
    found, kill_err = await box_py(sandbox, code)
    assert found == []
    assert kill_err in ("ESRCH", "EPERM")  # the host pid means nothing (or someone else) inside
    assert proc.poll() is None


@one_id_skip(
    "kill -1 reaches the agent too and ends their own box; the host stays out of reach "
    "(test_host_processes_are_invisible)"
)
async def test_kill_everything_reachable(
    sandbox: Sandbox, host_process: tuple[subprocess.Popen[bytes], str]
) -> None:
    """kill -9 -1 reaches the box's own processes only: the host and the agent survive."""
    proc, _ = host_process
    victim = await sandbox.spawn("sleep 600")
    r = await sandbox.run(["python3", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"])
    assert r.exit_code == 0
    assert (await victim.wait(10)).exit_code == -9  # the attack did run: the box's own died
    assert proc.poll() is None
    assert (await sandbox.run("echo alive")).stdout == "alive\n"


@one_id_skip("they can signal the agent, which ends their own box")
async def test_signal_the_guest_agent(sandbox: Sandbox) -> None:
    code = "import signal\nres = [err(os.kill, agent_pid(), s) for s in (9, 15, 19)]"
    assert await box_py(sandbox, code) == ["EPERM"] * 3
    assert (await sandbox.run("echo alive")).stdout == "alive\n"


async def test_signal_the_box_init(sandbox: Sandbox) -> None:
    if ONE_ID and sandbox.policy.backend == "oci":
        pytest.skip(
            "rootless, one id: an OCI box's init is the agent, whose id commands share: they "
            "can signal it, ending their own box (SECURITY.md, Rootless)"
        )
    code = "res = err(os.kill, os.getppid() if agent_pid() == 1 else 1, 9)"
    assert await box_py(sandbox, code) == "EPERM"


async def test_leave_the_cgroup(sandbox: Sandbox) -> None:
    """Write our pid into every cgroup.procs the box can see (the host's root groups when
    cgroupfs is bound in): each write fails and our membership is unchanged."""
    code = (
        "import glob\n"
        "before = open('/proc/self/cgroup').read()\n"
        "targets = glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True)\n"
        "errs = sorted({err(lambda t=t: open(t, 'w').write(str(os.getpid()))) for t in targets})\n"
        "res = [errs, open('/proc/self/cgroup').read() == before, len(targets)]"
    )
    errs, unchanged, _ = await box_py(sandbox, code)
    assert set(errs) <= {"EROFS", "EACCES"} and unchanged


async def test_lower_oom_score_to_make_the_host_die_first(sandbox: Sandbox) -> None:
    code = (
        "fd = os.open('/proc/self/oom_score_adj', os.O_WRONLY)\n"
        "res = [err(os.write, fd, b'-1000'), open('/proc/self/oom_score_adj').read().strip()]"
    )
    failure, value = await box_py(sandbox, code)
    if gvisor(sandbox):
        # The score is gVisor's own bookkeeping: the host's OOM killer sees its kernel's.
        for pid in host_pids_mentioning(sandbox.sandbox_id):
            assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() != "-1000"
        return
    assert failure in ("EACCES", "EPERM", "EIO") and value != "-1000"


async def test_realtime_priority_to_starve_the_host(sandbox: Sandbox) -> None:
    code = (
        "res = [err(os.sched_setscheduler, 0, os.SCHED_FIFO, os.sched_param(50)),"
        " err(os.setpriority, os.PRIO_PROCESS, 0, -20)]"
    )
    res = await box_py(sandbox, code)
    if gvisor(sandbox):
        # gVisor's scheduler is the host's for its own threads: a box can neither pick a
        # real-time policy (EINVAL: not implemented) nor touch the host threads' nice values.
        assert res[0] in ("EPERM", "EINVAL")
        for pid in host_pids_mentioning(sandbox.sandbox_id):
            assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) >= 0
        return
    assert res == ["EPERM", "EACCES"]


async def _survivor_check(policy: Policy, workspace: Path, command: str, marker: str) -> None:
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(command, timeout=10)
        assert r.exit_code == 0, r.stderr
        seen = await sb.run(f"pgrep -f {marker} || true")
        assert seen.stdout.strip(), "the daemon did not start: the test would prove nothing"
    assert host_pids_mentioning(marker) == []


async def test_double_fork_daemon_dies_with_the_sandbox(
    box_policy: Policy, workspace: Path
) -> None:
    marker = f"daemon{secrets.token_hex(4)}"
    command = (
        "python3 -c 'import os, sys, time\n"
        "if os.fork(): sys.exit(0)\n"
        "os.setsid()\n"
        "if os.fork(): sys.exit(0)\n"
        "os.closerange(0, 3)\n"
        'os.execvp("sh", ["sh", "-c", "trap \\"\\" TERM HUP INT; '
        f"while :; do sleep 1; done # {marker}\"])'"
        f"; for i in $(seq 100); do pgrep -f {marker} >/dev/null && break; sleep 0.05; done"
    )
    await _survivor_check(box_policy, workspace, command, marker)


async def test_setsid_nohup_background_dies_with_the_sandbox(
    box_policy: Policy, workspace: Path
) -> None:
    marker = f"nohup{secrets.token_hex(4)}"
    command = (
        f"setsid nohup sh -c 'while :; do sleep 1; done # {marker}' >/dev/null 2>&1 & "
        f"for i in $(seq 100); do pgrep -f {marker} >/dev/null && break; sleep 0.05; done"
    )
    await _survivor_check(box_policy, workspace, command, marker)


async def test_fork_from_a_pty_session_dies_with_the_sandbox(
    box_policy: Policy, workspace: Path
) -> None:
    marker = f"ptyjob{secrets.token_hex(4)}"
    async with Sandbox(box_policy, workspace=workspace) as sb:
        session = await sb.shell()
        await session.write(
            f"setsid sh -c 'while :; do sleep 1; done # {marker}' & "
            f"while ! pgrep -f {marker} >/dev/null; do :; done; echo RE''ADY\n"
        )
        assert (await session.expect("READY", 10)).matched
    assert host_pids_mentioning(marker) == []
    assert not os.path.exists(f"/run/corral/boxes/{sb.sandbox_id}")
