"""The limits contract: the same policy gives the same effective limits on every backend, or
the backend refuses naming the field. Never a silent clamp, never a generic failure.

Each policy runs on each backend of the contract (``backend_name``: bwrap, oci-runc, oci-crun,
and the microVM when ``CORRAL_TEST_BACKENDS`` names it) plus a microVM slice that restores
the saved VM of ``tests/test_microvm.py``. What is checked, per box:
- ``info()`` reports the effective limits, the same numbers everywhere (the policy's, in the
  kernel's units: whole pages, microseconds of a 100 ms period);
- the cgroup holds them (read on the host for bwrap and OCI, in the guest for the microVM);
- from inside: ``ulimit`` shows the rlimits, and a fork loop gets the same number of
  processes on every backend (``max_pids`` counts the agent, not a backend's own helpers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral import Policy, PolicyError, Sandbox
from corral.backends import unavailable_reason
from corral.backends.host import cgroups
from corral.backends.limits import DEFAULT_NOFILE

pytestmark = [pytest.mark.slow]

LIMITS: dict[str, dict[str, Any]] = {
    "tight": {
        "memory_bytes": "64M",
        "cpu_quota": 0.29,  # int(0.29 * 100_000) is 28999: rounded, it is 29000 everywhere
        "max_pids": 16,
        "rlimits": {"nofile": 128, "fsize": 1 << 20},
    },
    "odd": {"memory_bytes": 100_000_001, "cpu_quota": 1.5, "max_pids": None, "rlimits": {}},
}
EXPECTED: dict[str, dict[str, Any]] = {
    "tight": {
        "memory_limit_bytes": 64 << 20,
        "cpu_quota": 0.29,
        "max_pids": 16,
        "rlimits": {"core": 0, "nofile": 128, "fsize": 1 << 20},
    },
    "odd": {
        "memory_limit_bytes": 100_000_001 // 4096 * 4096,
        "cpu_quota": 1.5,
        "max_pids": None,
        "rlimits": {"core": 0, "nofile": DEFAULT_NOFILE},  # the planner's default
    },
}
FORKS_AT_16 = 14
"""Children a command may fork under ``max_pids = 16``: 16 less the agent and the command."""

FORK_LOOP = """
import os
r, w = os.pipe()
n = 0
try:
    while n < 64:
        if os.fork() == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        n += 1
except OSError:
    pass
os.close(w)
print(n)
"""

VM_POLICY: dict[str, Any] = {"backend": "microvm", "vm": {"cpus": 2, "memory_mb": 384}}
"""The shape of tests/test_microvm.py: its saved VM restores in about a second."""


def host_cgroup(sandbox_id: str) -> dict[str, int | None]:
    """The box's cgroup limits as the host's cgroup files hold them."""
    support = cgroups.detect()

    def read(controller: str, name: str) -> str:
        v2 = support.version == "v2"
        base = Path(support.root if v2 else support.mounts[controller])
        return (base / cgroups.PARENT / sandbox_id / name).read_text().strip()

    if support.version == "v2":
        memory, (quota, _) = read("memory", "memory.max"), read("cpu", "cpu.max").split()
        pids = read("pids", "pids.max")
    else:
        memory = read("memory", "memory.limit_in_bytes")
        quota = read("cpu", "cpu.cfs_quota_us")
        pids = read("pids", "pids.max")
    unlimited = {"max", "-1", "9223372036854771712"}
    return {
        "memory": None if memory in unlimited else int(memory),
        "cpu_us": None if quota in unlimited else int(quota),
        "pids": None if pids in unlimited else int(pids),
    }


async def guest_cgroup(sb: Sandbox) -> dict[str, int | None]:
    """The microVM's guest cgroup limits, read inside the VM."""
    r = await sb.run("cd /sys/fs/cgroup/box && cat memory.max cpu.max pids.max", timeout=60)
    memory, quota, _, pids = r.stdout.split()
    return {
        "memory": None if memory == "max" else int(memory),
        "cpu_us": None if quota == "max" else int(quota),
        "pids": None if pids == "max" else int(pids),
    }


async def check_rootless_box(sb: Sandbox, info: dict[str, Any], name: str) -> None:
    """Rootless without a delegated cgroup: the same numbers where an rlimit can hold them
    (RLIMIT_AS per process for memory, RLIMIT_NPROC for the command user's processes), and
    what none can (a CPU quota) listed as unenforced, never silently dropped."""
    expected = EXPECTED[name]
    memory, pids, quota = (expected[k] for k in ("memory_limit_bytes", "max_pids", "cpu_quota"))
    rl = {**expected["rlimits"], "as": memory, **({} if pids is None else {"nproc": pids})}
    assert info["rlimits"] == rl
    unenforced = " ".join(info["unenforced"])
    assert "memory_bytes" in unenforced and ("cpu_quota" in unenforced) is (quota is not None)
    code = "from resource import *; print(getrlimit(RLIMIT_AS)[1], getrlimit(RLIMIT_NPROC)[1])"
    r = await sb.run(["python3", "-c", code], timeout=60)
    vmem, procs = r.stdout.split()
    assert vmem == str(memory) and (pids is None or procs == str(pids)), r  # None: the user's


async def check_box(sb: Sandbox, name: str, own_pids: int) -> None:
    info = await sb.info()
    if (info.get("rootless") or {}).get("limits") == "rlimits":
        await check_rootless_box(sb, info, name)
        return
    expected = EXPECTED[name]
    assert {k: info[k] for k in expected} == expected
    assert not [w for w in info["unenforced"] if w.startswith("limits.")], info["unenforced"]
    quota = expected["cpu_quota"]
    pids = expected["max_pids"]
    held = {
        "memory": expected["memory_limit_bytes"],
        "cpu_us": None if quota is None else round(quota * 100_000),
        "pids": None if pids is None else pids + own_pids,
    }
    if info["backend"] == "microvm":
        assert await guest_cgroup(sb) == held
    else:
        assert host_cgroup(sb.sandbox_id) == held
    r = await sb.run("ulimit -n; ulimit -c; ulimit -f", timeout=60)
    nofile, core, fsize = r.stdout.split()
    rl = expected["rlimits"]
    assert core == "0"
    assert nofile == str(rl.get("nofile", nofile))
    assert fsize == ("unlimited" if "fsize" not in rl else str(rl["fsize"] // 512))  # blocks
    if pids is not None:
        r = await sb.run(["python3", "-c", FORK_LOOP], timeout=60)
        assert int(r.stdout) == pids - 2, r


def own_pids(backend_name: str) -> int:
    """bwrap's init sits beside the agent; on cgroup v1 bwrap is born in the box's cgroup
    (no move, no grace period on the start's path), so its monitor sits there too."""
    if backend_name != "bwrap":
        return 0
    return 2 if cgroups.detect().version == "v1" else 1


@pytest.mark.parametrize("name", sorted(LIMITS))
async def test_the_same_limits_on_every_backend(
    box_policy: Policy, backend_name: str, name: str, workspace: Path
) -> None:
    policy = Policy.from_dict({**box_policy.model_dump(exclude_unset=True), "limits": LIMITS[name]})
    if policy.backend == "microvm":
        policy = Policy.from_dict({**VM_POLICY, "limits": LIMITS[name]})
    async with Sandbox(policy, workspace=workspace) as sb:
        await check_box(sb, name, own_pids(backend_name))


async def test_the_default_limits_agree(box_policy: Policy, workspace: Path) -> None:
    async with Sandbox(box_policy, workspace=workspace) as sb:
        info = await sb.info()
    assert (info["memory_limit_bytes"], info["cpu_quota"], info["max_pids"]) == (1 << 30, None, 256)
    rlimits: dict[str, int] = {"core": 0, "nofile": DEFAULT_NOFILE}
    if (info.get("rootless") or {}).get("limits") == "rlimits":  # no cgroup: per process
        rlimits |= {"as": 1 << 30, "nproc": 256}
    assert info["rlimits"] == rlimits


async def test_a_limit_that_skipped_validation_is_refused_naming_it(
    box_policy: Policy, workspace: Path
) -> None:
    """``model_copy`` does not validate: the planner refuses before anything starts."""
    for update, field in (
        ({"memory_bytes": 1 << 20}, "limits.memory_bytes"),
        ({"cpu_quota": 0.005}, "limits.cpu_quota"),
        ({"max_pids": 2}, "limits.max_pids"),
    ):
        bad = box_policy.model_copy(update={"limits": box_policy.limits.model_copy(update=update)})
        with pytest.raises(PolicyError, match=f"^{field}: "):
            async with Sandbox(bad, workspace=workspace):
                pass


def test_the_issues_example_is_refused_by_the_policy_on_every_backend() -> None:
    for backend in ({}, {"backend": "oci"}, {"backend": "microvm"}):
        with pytest.raises(PolicyError) as info:
            Policy.from_dict({**backend, "limits": {"memory_bytes": "1M", "cpu_quota": 0.005}})
        assert "limits.memory_bytes: " in info.value.message
        assert "limits.cpu_quota: " in info.value.message


# ---- the microVM slice ----------------------------------------------------------------------

VM_SKIP = unavailable_reason(Policy.from_dict({**VM_POLICY, "limits": {"memory_bytes": "64M"}}))


@pytest.mark.skipif(VM_SKIP is not None, reason=f"microvm backend unavailable: {VM_SKIP}")
async def test_the_same_limits_in_a_microvm(tmp_path: Path) -> None:
    policy = Policy.from_dict({**VM_POLICY, "limits": LIMITS["tight"]})
    async with Sandbox(policy, workspace=tmp_path) as sb:
        await check_box(sb, "tight", 0)
        info = await sb.info()
        assert info["vm_memory_mb"] == 384


@pytest.mark.skipif(VM_SKIP is not None, reason=f"microvm backend unavailable: {VM_SKIP}")
async def test_a_microvm_too_small_for_its_limit_is_refused(tmp_path: Path) -> None:
    policy = Policy.from_dict(VM_POLICY | {"limits": {"memory_bytes": "192M"}})
    bad = policy.model_copy(
        update={"limits": policy.limits.model_copy(update={"memory_bytes": 1 << 30})}
    )
    with pytest.raises(PolicyError, match=r"^limits\.memory_bytes: .* 384 MiB"):
        async with Sandbox(bad, workspace=tmp_path):
            pass
