"""The limits planner (pure) and the policy rules it relies on: minimums, units, VM RAM."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral import Policy, PolicyError
from corral.backends.limits import (
    DEFAULT_NOFILE,
    PAGE_SIZE,
    Capabilities,
    agent_rlimits,
    plan_limits,
)
from corral.bounds import MAX_PIDS
from corral.policy import (
    CPU_PERIOD_US,
    MIN_CPU_QUOTA,
    MIN_MEMORY_BYTES,
    MIN_PIDS,
    VM_GUEST_MEMORY_MB,
    Limits,
    vm_memory_mb,
    vm_room,
)

V1 = Capabilities("cgroup v1", swap="capped", own_pids=1)
GVISOR = Capabilities("cgroup v1", swap="capped", own_pids=256, own_memory_bytes=48 << 20)
V2 = Capabilities("cgroup v2", swap="inactive")
GUEST = Capabilities("guest cgroup v2", swap="inactive", vm_memory_mb=1280, vm_cpus=2)
NONE = Capabilities("none", controllers=frozenset(), reason="cgroups are read-only here")

memory = st.one_of(st.none(), st.integers(MIN_MEMORY_BYTES, 1 << 40))
quota = st.one_of(st.none(), st.floats(MIN_CPU_QUOTA, 64.0))
pids = st.one_of(st.none(), st.integers(MIN_PIDS, 1 << 22))
limits = st.builds(Limits, memory_bytes=memory, cpu_quota=quota, max_pids=pids)
caps = st.sampled_from([V1, V2, GVISOR, NONE])


@given(limits, caps)
def test_effective_values_are_what_the_kernel_keeps(lim: Limits, cap: Capabilities) -> None:
    plan = plan_limits(lim, cap)
    if lim.memory_bytes is None:
        assert plan.memory_bytes is None
    else:
        assert plan.memory_bytes is not None
        assert plan.memory_bytes % PAGE_SIZE == 0
        assert 0 <= lim.memory_bytes - plan.memory_bytes < PAGE_SIZE
    if lim.cpu_quota is None:
        assert plan.cpu_quota is None and plan.cpu_quota_us is None
    else:
        assert plan.cpu_quota_us is not None and plan.cpu_quota is not None
        assert plan.cpu_quota_us >= 1000  # the kernel's smallest quota
        assert abs(plan.cpu_quota - lim.cpu_quota) <= 0.5 / CPU_PERIOD_US
    assert plan.max_pids == lim.max_pids
    if lim.max_pids is not None:
        # the backend's own processes on top, within the kernel's PID_MAX_LIMIT
        assert plan.pids_max == min(lim.max_pids + cap.own_pids, MAX_PIDS)
    if plan.memory_bytes is not None:
        assert plan.memory_max == plan.memory_bytes + cap.own_memory_bytes


@given(limits)
def test_every_backend_plans_the_same_numbers(lim: Limits) -> None:
    """Where limits are enforced at all, bwrap (v1), OCI (v2) and a big enough VM agree."""
    vm = Capabilities("guest cgroup v2", swap="inactive", vm_memory_mb=1 << 30, vm_cpus=64)
    described = [plan_limits(lim, cap).describe() for cap in (V1, V2, vm)]
    for d in described:
        d.pop("limits_enforced_by")
    assert described[0] == described[1] == described[2]


@given(limits)
def test_a_limit_not_enforced_is_named_never_dropped(lim: Limits) -> None:
    plan = plan_limits(lim, NONE)
    asked = {n for n in ("memory_bytes", "cpu_quota", "max_pids") if getattr(lim, n) is not None}
    named = {w.split()[0].removeprefix("limits.") for w in plan.warnings}
    assert named == asked == plan.unenforced
    assert all("cgroups are read-only here" in w for w in plan.warnings)


def test_a_missing_controller_is_named() -> None:
    cap = Capabilities("cgroup v2", controllers=frozenset({"memory", "pids"}), swap="inactive")
    plan = plan_limits(Limits(cpu_quota=0.5), cap)
    assert plan.warnings == ("limits.cpu_quota not enforced: no cpu controller (cgroup v2)",)
    assert plan.cpu_quota == 0.5  # still what the policy says: the warning tells it is not held


def test_swap_that_can_extend_the_cap_is_reported() -> None:
    plan = plan_limits(Limits(), Capabilities("cgroup v1", swap="uncapped"))
    assert not plan.swap_capped
    assert any(w.startswith("limits.memory_bytes does not cap swap") for w in plan.warnings)
    assert plan_limits(Limits(), V1).swap_capped
    assert not plan_limits(Limits(memory_bytes=None), V1).swap_capped


def test_rlimits_always_forbid_core_dumps_unless_asked() -> None:
    assert dict(plan_limits(Limits(rlimits={"nofile": 64}), V1).rlimits) == {
        "core": 0,
        "nofile": 64,
    }
    assert plan_limits(Limits(rlimits={"core": 1 << 20}), V1).rlimits["core"] == 1 << 20


def test_open_files_are_capped_by_default() -> None:
    assert dict(plan_limits(Limits(), V1).rlimits) == {"core": 0, "nofile": DEFAULT_NOFILE}
    # The agent inherits the cap; never below the default, which its own pipes count against.
    assert agent_rlimits(Limits()) == {"nofile": DEFAULT_NOFILE}
    assert agent_rlimits(Limits(rlimits={"nofile": 64})) == {"nofile": DEFAULT_NOFILE}
    assert agent_rlimits(Limits(rlimits={"nofile": 1 << 16})) == {"nofile": 1 << 16}


def test_vm_cpus_below_the_quota_are_reported() -> None:
    plan = plan_limits(Limits(cpu_quota=4), GUEST)
    assert plan.cpu_quota == 4.0
    assert plan.warnings == (
        "limits.cpu_quota 4 exceeds the VM's 2 CPUs (vm.cpus): the box gets at most those",
    )


def test_a_memory_limit_the_vm_cannot_hold_is_refused() -> None:
    small = Capabilities("guest cgroup v2", vm_memory_mb=384, vm_cpus=1)
    with pytest.raises(PolicyError, match=r"^limits\.memory_bytes: .* 384 MiB"):
        plan_limits(Limits(), small)
    fits = Limits(memory_bytes=vm_room(384) // PAGE_SIZE * PAGE_SIZE)
    assert plan_limits(fits, small).memory_bytes == fits.memory_bytes


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"memory_bytes": 1 << 20}, "limits.memory_bytes"),
        ({"cpu_quota": 0.005}, "limits.cpu_quota"),
        ({"max_pids": 1}, "limits.max_pids"),
        ({"rlimits": {"nofile": -1}}, "limits.rlimits.nofile"),
    ],
)
def test_limits_that_skipped_validation_are_refused_by_the_planner(
    update: dict[str, object], field: str
) -> None:
    bypassed = Limits().model_copy(update=update)  # model_copy does not validate
    with pytest.raises(PolicyError, match=f"^{field}: "):
        plan_limits(bypassed, V2)


# ---- the policy side: minimums and units, each a PolicyError naming its field ------------


@pytest.mark.parametrize(
    ("limits", "field", "needle"),
    [
        ({"memory_bytes": "1M"}, "limits.memory_bytes", "below the minimum a box can start with"),
        ({"memory_bytes": "15.9M"}, "limits.memory_bytes", "16 MiB"),
        ({"memory_bytes": "lots"}, "limits.memory_bytes", "not a size"),
        ({"memory_bytes": 0}, "limits.memory_bytes", "greater than 0"),
        ({"cpu_quota": 0.005}, "limits.cpu_quota", "1 ms per 100 ms"),
        ({"cpu_quota": 5000}, "limits.cpu_quota", "outside"),
        ({"cpu_quota": float("nan")}, "limits.cpu_quota", "finite"),
        ({"cpu_quota": float("inf")}, "limits.cpu_quota", "finite"),
        ({"max_pids": 3}, "limits.max_pids", "minimum"),
        ({"rlimits": {"nofile": -1}}, "limits.rlimits.nofile", "greater than or equal to 0"),
        ({"exec_timeout_secs": float("inf")}, "limits.exec_timeout_secs", "finite"),
    ],
)
def test_policy_refuses_limits_a_box_cannot_have(
    limits: dict[str, object], field: str, needle: str
) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"limits": limits})
    assert f"{field}: " in info.value.message
    assert needle in info.value.message


def test_the_issues_example_is_refused_naming_both_fields() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"limits": {"memory_bytes": "1M", "cpu_quota": 0.005}})
    assert "limits.memory_bytes: " in info.value.message
    assert "limits.cpu_quota: " in info.value.message


def test_the_smallest_limits_are_accepted() -> None:
    lim = Policy.from_dict(
        {"limits": {"memory_bytes": "16M", "cpu_quota": 0.01, "max_pids": 4}}
    ).limits
    assert (lim.memory_bytes, lim.cpu_quota, lim.max_pids) == (16 << 20, 0.01, 4)


def test_vm_ram_follows_the_memory_limit_by_default() -> None:
    default = Policy(backend="microvm")
    assert default.limits.memory_bytes is not None
    assert vm_memory_mb(default) == 1280  # 1 GiB + 128 MiB + 128 MiB
    small = Policy.from_dict({"backend": "microvm", "limits": {"memory_bytes": "192M"}})
    assert vm_memory_mb(small) == 384
    unlimited = Policy.from_dict({"backend": "microvm", "limits": {"memory_bytes": None}})
    assert vm_memory_mb(unlimited) == 512
    given_ram = Policy.from_dict({"backend": "microvm", "vm": {"memory_mb": 2048}})
    assert vm_memory_mb(given_ram) == 2048


@given(st.integers(MIN_MEMORY_BYTES, 1 << 36))
def test_derived_vm_ram_always_holds_the_limit(limit: int) -> None:
    policy = Policy.from_dict({"backend": "microvm", "limits": {"memory_bytes": limit}})
    ram = vm_memory_mb(policy)
    assert ram % 64 == 0
    assert vm_room(ram) >= limit
    assert ram == 64 or vm_room(ram - 64) < limit  # the smallest such VM
    assert (ram - VM_GUEST_MEMORY_MB) << 20 >= limit + limit // 8
    caps = Capabilities("guest cgroup v2", swap="inactive", vm_memory_mb=ram, vm_cpus=1)
    assert plan_limits(policy.limits, caps).memory_bytes == limit // PAGE_SIZE * PAGE_SIZE


def test_a_vm_too_small_for_its_limit_is_refused_by_the_policy() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"backend": "microvm", "vm": {"memory_mb": 384}})
    message = info.value.message
    assert "limits.memory_bytes: 1024 MiB does not fit in the VM: vm.memory_mb 384" in message
    assert "at most 227 MiB" in message
    # Other backends ignore vm.*; a limit that fits is fine.
    Policy.from_dict({"vm": {"memory_mb": 384}})
    Policy.from_dict(
        {"backend": "microvm", "vm": {"memory_mb": 384}, "limits": {"memory_bytes": "192M"}}
    )
