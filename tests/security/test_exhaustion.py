"""Resource exhaustion: each attack runs in a box with small limits and must be contained and
reported (``oom_killed``, ``pids_limited``, ``timed_out``, ``truncated``), while a second box
keeps answering: the latency of ``true`` there, before and during the attack, goes to the
security report."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox, SandboxBroken
from corral.errors import FileTooLarge, SandboxError
from corral.tools import Toolbox
from security.conftest import backend_label, record_figure
from security.helpers import rlimits_only

pytestmark = [pytest.mark.exhaustion, pytest.mark.needs_bwrap]

MEMORY = 64 << 20
PIDS = 32
TMP = 16 << 20
OUTPUT = 64 << 10


@pytest.fixture
def small_policy(box_policy: Policy) -> Policy:
    return Policy.from_dict(
        {
            **box_policy.model_dump(mode="json", exclude={"limits", "filesystem"}),
            "filesystem": {**box_policy.filesystem.model_dump(mode="json"), "tmp_size": TMP},
            "limits": {
                "memory_bytes": MEMORY,
                "max_pids": PIDS,
                "cpu_quota": 1.0,
                "output_bytes": OUTPUT,
                "rlimits": {"core": 0, "nofile": 256, "fsize": 8 << 20},
            },
        }
    )


@pytest.fixture
async def attacked(small_policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    async with Sandbox(small_policy, workspace=workspace) as sb:
        yield sb


@pytest.fixture
async def bystander(box_policy: Policy, tmp_path: Path) -> AsyncIterator[Sandbox]:
    """A second, unrelated box: its responsiveness is the host's, seen by a user."""
    ws = tmp_path / "bystander"
    ws.mkdir()
    async with Sandbox(box_policy, workspace=ws) as sb:
        yield sb


async def _latencies(sb: Sandbox, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        r = await sb.run(["true"], timeout=10)
        out.append(time.perf_counter() - t0)
        assert r.exit_code == 0
    return out


async def under_attack(
    name: str,
    bystander: Sandbox,
    attack: Callable[[], Coroutine[Any, Any, Any]],
    *,
    samples: int = 10,
) -> Any:
    """Run ``attack`` while timing ``true`` in the bystander box; record the figures."""
    baseline = await _latencies(bystander, 5)
    task = asyncio.create_task(attack())
    during: list[float] = []
    try:
        while not task.done() and len(during) < samples:
            during += await _latencies(bystander, 1)
        result = await task
    finally:
        if not task.done():
            task.cancel()
    record_figure(
        kind="responsiveness",
        attack=name,
        backend=backend_label(bystander.policy),
        baseline_ms=round(statistics.median(baseline) * 1000, 2),
        median_ms=round(statistics.median(during) * 1000, 2) if during else None,
        max_ms=round(max(during) * 1000, 2) if during else None,
        samples=len(during),
    )
    if during:
        assert max(during) < 5.0, f"the host stalled during the {name}: {during}"
    return result


async def test_fork_bomb(attacked: Sandbox, bystander: Sandbox) -> None:
    async def attack() -> Any:
        # The shell itself spins (a builtin loop), so the bomb runs until the timeout.
        return await attacked.run("b(){ b | b & }; b; while :; do :; done", timeout=2)

    r = await under_attack("fork bomb", bystander, attack)
    if await rlimits_only(attacked):  # RLIMIT_NPROC refuses the forks; no cgroup counts them
        assert "Cannot fork" in r.stderr and (r.timed_out or r.exit_code != 0), r
        return
    # Refused forks are reported; the command ran until its timeout, or its own shell gave
    # up ("Cannot fork") once the limit was reached.
    assert r.pids_limited and (r.timed_out or r.exit_code != 0)
    assert attacked.stats().pids_limit_hits > 0
    assert (attacked.stats().pids or 0) <= PIDS


async def test_memory_bomb(attacked: Sandbox, bystander: Sandbox) -> None:
    async def attack() -> Any:
        code = "b = []\nwhile True:\n    b.append(bytearray(8 << 20))"
        return await attacked.run(["python3", "-c", code], timeout=10)

    if attacked.policy.runtime == "runsc":
        # gVisor's kernel is the biggest process of the box's cgroup: the host's OOM killer
        # ends the whole box (its memory never exceeds the cap), not just the command.
        with contextlib.suppress(SandboxBroken):
            await under_attack("memory bomb", bystander, attack)
        assert (await bystander.run("echo alive")).stdout == "alive\n"
        return
    r = await under_attack("memory bomb", bystander, attack)
    if await rlimits_only(attacked):  # RLIMIT_AS: the allocation fails, nothing is killed
        assert "MemoryError" in r.stderr and r.exit_code == 1, r
        assert (await attacked.run("echo alive")).stdout == "alive\n"
        return
    assert r.oom_killed and r.exit_code == -9
    assert (attacked.stats().memory_peak_bytes or 0) <= MEMORY + (1 << 20)
    assert (await attacked.run("echo alive")).stdout == "alive\n"


async def test_cpu_spinner_on_every_core(attacked: Sandbox, bystander: Sandbox) -> None:
    cores = os.cpu_count() or 1

    async def attack() -> Any:
        spin = " ".join(["while :; do :; done &"] * cores)
        return await attacked.run(f"{spin} wait", timeout=2)

    r = await under_attack("cpu spinner", bystander, attack)
    assert r.timed_out
    assert (await attacked.run("echo alive")).stdout == "alive\n"


async def test_output_flood(attacked: Sandbox, bystander: Sandbox) -> None:
    """Gigabytes to stdout: capture stays within output_bytes (head and tail), bounded time."""

    async def attack() -> Any:
        t0 = time.perf_counter()
        r = await attacked.run("head -c 1G /dev/zero | tr '\\0' x", timeout=5)
        return r, time.perf_counter() - t0

    r, took = await under_attack("output flood", bystander, attack)
    assert r.truncated
    assert len(r.stdout) <= 2 * OUTPUT
    assert took < 15
    record_figure(
        kind="output_flood",
        backend=backend_label(attacked.policy),
        seconds=round(took, 2),
        completed=not r.timed_out,
        captured_chars=len(r.stdout),
    )


async def test_tmp_fill(attacked: Sandbox) -> None:
    before = os.statvfs("/tmp").f_bavail
    # Several files: rlimits.fsize (8 MiB) caps each one, the tmpfs size caps them all.
    r = await attacked.run(
        "for i in 1 2 3 4; do cat /dev/zero > /tmp/fill$i; done; df -k /tmp | tail -1", timeout=10
    )
    assert "No space left on device" in r.stderr
    used = int(r.stdout.split()[2]) * 1024
    assert used <= TMP
    assert os.statvfs("/tmp").f_bavail >= before - (4 << 20) // os.statvfs("/tmp").f_frsize


async def test_workspace_fill_is_capped_per_file(attacked: Sandbox, workspace: Path) -> None:
    """The workspace is a host directory: rlimits.fsize caps each file the box writes."""
    r = await attacked.run("dd if=/dev/zero of=big bs=1M count=64", timeout=10)
    assert r.exit_code in (-25, 128 + 25), r  # SIGXFSZ (as the shell reports it)
    assert (workspace / "big").stat().st_size <= 8 << 20


async def test_fd_exhaustion(attacked: Sandbox) -> None:
    host_fds = len(os.listdir("/proc/self/fd"))
    code = (
        "import os\nfds = []\n"
        "try:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as e:\n    print(len(fds), e.strerror)\n"
    )
    r = await attacked.run(["python3", "-c", code], timeout=10)
    count, _, why = r.stdout.strip().partition(" ")
    assert why == "Too many open files" and int(count) < 256
    assert abs(len(os.listdir("/proc/self/fd")) - host_fds) <= 2
    assert (await attacked.run("echo alive")).stdout == "alive\n"


async def test_huge_file_through_the_file_tools(attacked: Sandbox, workspace: Path) -> None:
    """A sparse 1 TiB file: reads are refused by size, quickly, as structured errors."""
    (workspace / "huge").touch()  # made on the host: the box's own fsize cap is 8 MiB
    os.truncate(workspace / "huge", 1 << 40)  # sparse: no disk used
    t0 = time.perf_counter()
    with pytest.raises(FileTooLarge):
        await attacked.files.read("huge")
    tools = Toolbox(attacked)
    result = await tools.call("vfs_read", {"path": "huge"})
    assert result["error"]["code"]
    assert time.perf_counter() - t0 < 10
    # the payload is made off the loop: allocating it is the test's work, not corral's
    payload = await asyncio.to_thread(bytes, TMP + (1 << 20))
    with pytest.raises(SandboxError):
        await attacked.files.write("/tmp/big", payload)
