"""Limits planned once: a policy's :class:`~corral.policy.Limits` plus what a backend can
enforce here becomes the one :class:`LimitPlan` that backend applies and reports.

Pure: no I/O. Each backend says how it enforces limits (:class:`Capabilities`: a cgroup v1 or
v2 on the host, the guest kernel's cgroup in a microVM, or nothing) and writes the plan's
values as they are: bwrap into its cgroup files, OCI into ``linux.resources``, the microVM
into its guest cgroup and its RAM. So the same policy means the same numbers on every
backend, and ``info()`` reports them from the plan (``memory_limit_bytes``, ``cpu_quota``,
``max_pids``, ``rlimits``, ``limits_enforced_by``, ``unenforced``).

What the plan does with a value:
- enforce it exactly, in the kernel's units: memory in whole pages, CPU in microseconds of a
  100 ms period; what ``info()`` reports is what the cgroup files read back;
- warn, naming the field, when this host cannot enforce it (a missing controller, swap that
  could extend the memory cap, a CPU quota above a VM's CPUs);
- refuse with a :class:`~corral.errors.PolicyError` naming the field when the value is
  outside what :class:`~corral.policy.Limits` accepts (a policy built with ``model_copy``
  skips validation) or when the backend could only pretend to enforce it (a memory limit
  larger than the microVM's RAM). Refusals happen before a backend starts anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from corral.bounds import MAX_PIDS
from corral.errors import PolicyError
from corral.policy import (
    CPU_PERIOD_US,
    MAX_CPU_QUOTA,
    MIN_CPU_QUOTA,
    MIN_MEMORY_BYTES,
    MIN_PIDS,
    VM_GUEST_MEMORY_MB,
    Limits,
    vm_room,
)

__all__ = [
    "DEFAULT_NOFILE",
    "PAGE_SIZE",
    "Capabilities",
    "LimitPlan",
    "Mechanism",
    "Swap",
    "agent_rlimits",
    "plan_limits",
]

DEFAULT_NOFILE = 1024
"""Open files per command (soft = hard) when the policy sets no ``limits.rlimits.nofile``.

Without it every command inherited the host's hard limit (often 1048576), and a box's
commands could hold up to ``max_pids`` times that many open files. The kernel charges each
to the box's memory cgroup, but ``fs.file-max`` is one count for the whole host (only host
root may pass it), so the cap is what bounds one box's share: ``max_pids`` x 1024 (262144
with the default 256 processes). 1024 is Linux's usual soft limit, which programs expect;
a policy that needs more says so (``limits.rlimits.nofile``), and a call may lower it but
not raise it above the box's."""

PAGE_SIZE = 4096
"""Memory limits are kept in whole pages by the kernel (x86-64 and arm64 with 4 KiB pages)."""

Mechanism = Literal["cgroup v1", "cgroup v2", "guest cgroup v2", "rlimits", "none"]
Swap = Literal["capped", "inactive", "uncapped"]

CGROUP_LIMITS = ("memory_bytes", "cpu_quota", "max_pids")
_CONTROLLER = {"memory_bytes": "memory", "cpu_quota": "cpu", "max_pids": "pids"}


@dataclass(frozen=True, slots=True)
class Capabilities:
    """How a backend enforces limits on this host (the backend builds it from what it found).

    mechanism: where the cgroup limits live; "none" enforces none of them (``reason`` why).
    controllers: the usable controllers among "memory", "cpu", "pids".
    swap: "capped" when the memory limit caps swap too (v1 memsw, v2 ``memory.swap.max``),
        "inactive" when the host has no swap, "uncapped" when swap could extend the cap.
    own_pids: processes the backend itself keeps in the box's cgroup beside the guest agent
        (bwrap's init: 1). They are added to ``pids.max``, so ``max_pids`` leaves commands
        the same room on every backend.
    own_memory_bytes: memory the backend's own processes charge to the box's cgroup (gVisor's
        kernel), added to the cgroup's cap in the same way.
    vm_memory_mb, vm_cpus: a microVM's RAM and CPUs, which bound what its limits can mean.
    """

    mechanism: Mechanism
    controllers: frozenset[str] = frozenset({"memory", "cpu", "pids"})
    swap: Swap = "capped"
    own_pids: int = 0
    own_memory_bytes: int = 0
    vm_memory_mb: int | None = None
    vm_cpus: int | None = None
    reason: str = ""
    rlimit_fallback: bool = False
    """What no controller enforces becomes a per-command rlimit (a rootless box in a
    delegated cgroup that lacks some controllers); always so for mechanism "rlimits"."""


@dataclass(frozen=True, slots=True)
class LimitPlan:
    """The limits one box gets, in the units the kernel takes, and what is not enforced."""

    mechanism: Mechanism
    memory_bytes: int | None
    """The memory cap in bytes (whole pages), or None."""
    memory_max: int | None
    """What the cgroup's memory cap gets: ``memory_bytes`` plus the backend's own use."""
    swap_capped: bool
    """Cap memory+swap at ``memory_bytes`` too (v1 ``memsw``; v2 ``memory.swap.max`` = 0)."""
    cpu_quota_us: int | None
    """Microseconds of CPU per :attr:`cpu_period_us`, or None."""
    max_pids: int | None
    """Processes and threads of the box, its guest agent included, as the policy says."""
    pids_max: int | None
    """What the cgroup's ``pids.max`` gets: ``max_pids`` plus the backend's own processes."""
    rlimits: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Per-command rlimits (soft = hard) the guest agent sets, ``core = 0`` and the default
    ``nofile`` (:data:`DEFAULT_NOFILE`) included."""
    unenforced: frozenset[str] = frozenset()
    """Names of the limits asked for that nothing here enforces (``memory_bytes``, ...)."""
    warnings: tuple[str, ...] = ()
    """One sentence per limit not (fully) enforced here, naming the field."""
    cpu_period_us: int = CPU_PERIOD_US
    own_pids: int = 0
    """Processes the backend itself keeps in the box's cgroup (not the box's to count)."""

    @property
    def cpu_quota(self) -> float | None:
        """The CPU cap in cores, as enforced."""
        if self.cpu_quota_us is None:
            return None
        return self.cpu_quota_us / self.cpu_period_us

    def describe(self) -> dict[str, Any]:
        """The effective limits for ``info()``: the same keys on every backend (the box adds
        :attr:`warnings` to its ``unenforced`` list)."""
        return {
            "memory_limit_bytes": self.memory_bytes,
            "cpu_quota": self.cpu_quota,
            "max_pids": self.max_pids,
            "rlimits": dict(self.rlimits),
            "limits_enforced_by": self.mechanism,
        }


def plan_limits(limits: Limits, caps: Capabilities) -> LimitPlan:
    """Turn ``limits`` into the plan a backend with ``caps`` applies (PolicyError: refused)."""
    _check(limits)
    warnings: list[str] = []
    memory = None if limits.memory_bytes is None else limits.memory_bytes // PAGE_SIZE * PAGE_SIZE
    quota = None if limits.cpu_quota is None else round(limits.cpu_quota * CPU_PERIOD_US)
    vm_ram = caps.vm_memory_mb
    if memory is not None and vm_ram is not None and memory > vm_room(vm_ram):
        raise PolicyError(
            f"limits.memory_bytes: {memory} bytes does not fit in the VM's "
            f"{caps.vm_memory_mb} MiB of RAM (the guest itself takes {VM_GUEST_MEMORY_MB} "
            "MiB + 1/8 of the limit); lower the limit or raise vm.memory_mb"
        )
    if quota is not None and caps.vm_cpus is not None and quota > caps.vm_cpus * CPU_PERIOD_US:
        warnings.append(
            f"limits.cpu_quota {limits.cpu_quota:g} exceeds the VM's {caps.vm_cpus} CPUs "
            "(vm.cpus): the box gets at most those"
        )
    asked = {name for name in CGROUP_LIMITS if getattr(limits, name) is not None}
    unenforced = {
        name
        for name in asked
        if caps.mechanism in ("none", "rlimits") or _CONTROLLER[name] not in caps.controllers
    }
    rlimits = _command_rlimits(limits)
    silent: set[str] = set()
    if caps.mechanism == "rlimits" or caps.rlimit_fallback:
        why = caps.reason if caps.mechanism == "rlimits" else f"no such controller ({caps.reason})"
        silent = _rlimit_fallback(limits, memory, rlimits, why, warnings, unenforced)
    for name in sorted(unenforced - silent):
        why = caps.reason or "no cgroups here"
        if caps.mechanism not in ("none", "rlimits"):
            why = f"no {_CONTROLLER[name]} controller ({caps.mechanism})"
        warnings.append(f"limits.{name} not enforced: {why}")
    memory_enforced = memory is not None and "memory_bytes" not in unenforced
    if memory_enforced and caps.swap == "uncapped":
        warnings.append(
            "limits.memory_bytes does not cap swap: the host swaps and its kernel has no swap "
            "accounting (boot with swapaccount=1), so a box can page out past the limit"
        )
    pids = limits.max_pids
    return LimitPlan(
        mechanism=caps.mechanism,
        memory_bytes=memory,
        memory_max=None if memory is None else memory + caps.own_memory_bytes,
        swap_capped=memory_enforced and caps.swap == "capped",
        cpu_quota_us=quota,
        max_pids=pids,
        # the backend's own processes on top, but no pids cgroup takes more than the kernel's
        # PID_MAX_LIMIT (nor can a host have more pids: the cap is the same)
        pids_max=None if pids is None else min(pids + caps.own_pids, MAX_PIDS),
        own_pids=caps.own_pids,
        rlimits=MappingProxyType(rlimits),
        unenforced=frozenset(unenforced),
        warnings=tuple(warnings),
    )


def _rlimit_fallback(
    limits: Limits,
    memory: int | None,
    rlimits: dict[str, int],
    why: str,
    warnings: list[str],
    unenforced: set[str],
) -> set[str]:
    """Without a cgroup (rootless, no delegated subtree): the cgroup limits each command can
    still get as an rlimit of its own, a weaker bound each warning names; returns the ones
    approximated (no cgroup enforces them, their warning is said here). A policy's own
    ``rlimits`` value wins."""
    approximated: set[str] = set()
    if memory is not None and "memory_bytes" in unenforced:
        approximated.add("memory_bytes")
        rlimits.setdefault("as", memory)
        warnings.append(
            f"limits.memory_bytes enforced per process only (RLIMIT_AS {rlimits['as']}: address "
            f"space, not a cap on the whole box; {why})"
        )
    if limits.max_pids is not None and "max_pids" in unenforced:
        approximated.add("max_pids")
        rlimits.setdefault("nproc", limits.max_pids)
        warnings.append(
            f"limits.max_pids enforced as RLIMIT_NPROC {rlimits['nproc']} on the command user's "
            f"processes in the box, not by a pids cgroup ({why})"
        )
    return approximated


def _command_rlimits(limits: Limits) -> dict[str, int]:
    """What every command gets: ``core = 0`` and ``nofile = DEFAULT_NOFILE`` unless the
    policy says otherwise, then the policy's own."""
    rlimits: dict[str, int] = {"core": 0, "nofile": DEFAULT_NOFILE}
    rlimits.update((str(name), value) for name, value in limits.rlimits.items())
    return rlimits


def agent_rlimits(limits: Limits) -> dict[str, int]:
    """The rlimits the guest agent sets on itself at start, for every command to inherit
    (soft = hard, so no command raises them): the open-file cap of :func:`plan_limits`, at
    least :data:`DEFAULT_NOFILE` (the agent's own pipes and PTYs count against it; a lower
    policy value is set per command, as a call's own rlimits are)."""
    return {"nofile": max(_command_rlimits(limits)["nofile"], DEFAULT_NOFILE)}


def _check(limits: Limits) -> None:
    """The rules of :class:`Limits` again, for a policy that skipped them (``model_copy``)."""
    m, q, p = limits.memory_bytes, limits.cpu_quota, limits.max_pids
    if m is not None and (not isinstance(m, int) or m < MIN_MEMORY_BYTES):
        raise PolicyError(
            f"limits.memory_bytes: {m!r} is below the minimum a box can start with "
            f"({MIN_MEMORY_BYTES} bytes)"
        )
    if q is not None and not (math.isfinite(q) and MIN_CPU_QUOTA <= q <= MAX_CPU_QUOTA):
        raise PolicyError(f"limits.cpu_quota: {q!r} is outside {MIN_CPU_QUOTA}..{MAX_CPU_QUOTA}")
    if p is not None and (not isinstance(p, int) or p < MIN_PIDS):
        raise PolicyError(
            f"limits.max_pids: {p!r} is below the minimum a box can run a command with ({MIN_PIDS})"
        )
    for name, value in limits.rlimits.items():
        if not isinstance(value, int) or value < 0:
            raise PolicyError(f"limits.rlimits.{name}: {value!r} is not a count >= 0")
