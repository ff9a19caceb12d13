"""Resource limits of the box's cgroup, enforced for real (bombs included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import Policy, PolicyError, Sandbox, SandboxError
from corral.backends.limits import DEFAULT_NOFILE

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]


async def test_memory_bomb_is_killed_and_reported(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"memory_bytes": "64M"}})
    async with Sandbox(policy, workspace=workspace) as sb:
        assert sb.oom_kills() == 0
        r = await sb.run(
            ["python3", "-c", "x = bytearray(400 << 20); print('survived')"], timeout=60
        )
        assert r.exit_code == -9
        assert r.oom_killed and r.ended == "oom_killed"
        assert "survived" not in r.stdout
        assert sb.stats().oom_kills >= 1
        assert sb.oom_kills() == sb.stats().oom_kills
        assert (await sb.run("echo still-usable")).stdout == "still-usable\n"


async def test_fork_bomb_is_capped_and_the_host_stays_responsive(
    workspace: Path, tmp_path: Path
) -> None:
    policy = Policy.from_dict({"limits": {"max_pids": 32}})
    bomb = (
        "import os, signal\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            signal.pause()\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('capped', n, e.errno)\n"
    )
    other_ws = tmp_path / "other"
    other_ws.mkdir()
    async with Sandbox(policy, workspace=workspace) as sb, Sandbox(workspace=other_ws) as other:
        r = await sb.run(["python3", "-c", bomb], timeout=60)
        word, forked, errno = r.stdout.split()
        assert word == "capped" and errno == "11"  # EAGAIN from the pids controller
        assert int(forked) < 32
        assert sb.stats().pids_limit_hits >= 1
        assert (sb.stats().pids or 0) <= 32
        # Another box (and so the host) still runs commands while the bomb's children live.
        assert (await other.run("echo responsive", timeout=30)).stdout == "responsive\n"


async def test_cpu_quota_throttles(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"cpu_quota": 0.2}})
    spin = (
        "import time, os\n"
        "w0, c0 = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - w0 < 1.0: pass\n"
        "print((time.process_time() - c0) / (time.monotonic() - w0))"
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", spin], timeout=30)
    share = float(r.stdout)
    assert share < 0.6, f"a 0.2-core quota let the spinner use {share:.2f} of a core"


async def test_rlimits_apply_to_commands(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"rlimits": {"nofile": 64, "fsize": 1024}}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("ulimit -n; head -c 4096 /dev/zero > big; echo $?")
        lines = r.stdout.split()
        assert lines[0] == "64"
        assert lines[1] != "0"
        r = await sb.run("ulimit -n", rlimits={"nofile": 32})
        assert r.stdout.strip() == "32"


async def test_open_files_default_to_the_planners_cap(workspace: Path) -> None:
    """No ``nofile`` in the policy: every command gets DEFAULT_NOFILE as soft and hard
    limit (inherited from the agent), and a call may lower it but not raise it."""
    async with Sandbox(Policy(), workspace=workspace) as sb:
        r = await sb.run("ulimit -Sn; ulimit -Hn")
        assert r.stdout.split() == [str(DEFAULT_NOFILE)] * 2
        assert (await sb.run("ulimit -n", rlimits={"nofile": 100})).stdout == "100\n"
        with pytest.raises(PolicyError, match=r"rlimits\.nofile: 5000 is above"):
            await sb.run("true", rlimits={"nofile": 5000})
        # Any other limit the agent holds for its commands (core dumps off): named, not a
        # failed pre-exec hook in the child.
        with pytest.raises(SandboxError, match=r"rlimits\.core: 4096 is above this box's limit"):
            await sb.run("true", rlimits={"core": 4096})
        assert (await sb.run("ulimit -c", rlimits={"core": 0})).stdout == "0\n"
    policy = Policy.from_dict({"limits": {"rlimits": {"nofile": 8192}}})
    async with Sandbox(policy, workspace=workspace) as sb:
        assert (await sb.run("ulimit -Hn")).stdout == "8192\n"


def test_limits_past_what_any_kernel_takes_are_policy_errors_naming_the_field() -> None:
    # 4194304 is the kernel's PID_MAX_LIMIT; an rlimit is a signed 64-bit count for the
    # guest agent. Both used to start a box that failed later with backend_failed.
    with pytest.raises(PolicyError, match=r"limits\.max_pids"):
        Policy(limits={"max_pids": 4194305})
    with pytest.raises(PolicyError, match=r"limits\.rlimits\.stack"):
        Policy(limits={"rlimits": {"stack": 2**63}})


async def test_the_largest_pids_limit_starts_a_box(workspace: Path) -> None:
    # bwrap's cgroup got max_pids plus its own two processes: past PID_MAX_LIMIT, EINVAL.
    async with Sandbox(Policy(limits={"max_pids": 4194304}), workspace=workspace) as sb:
        assert (await sb.info())["max_pids"] == 4194304
        assert (await sb.run(["true"])).exit_code == 0


async def test_an_rlimit_above_what_the_box_can_set_is_refused_naming_it(
    workspace: Path,
) -> None:
    # The box started and info() reported the limit; every command then failed with
    # backend_failed "Exception occurred in preexec_fn". nofile past fs.nr_open can never
    # be set, root or not.
    policy = Policy(limits={"rlimits": {"nofile": 10**9}})
    async with Sandbox(policy, workspace=workspace) as sb:
        with pytest.raises(SandboxError) as info:
            await sb.run(["true"])
        assert "rlimits.nofile" in info.value.message
        assert info.value.code.value != "backend_failed"
        assert "preexec" not in info.value.message
