"""Resource limits for sandboxes through Linux control groups (v1 and v2).

Each sandbox gets one group named ``corral/<name>``: under the cgroup2 root on a unified
(v2) host, or under the mount point of every needed controller on a legacy/hybrid (v1)
host (``/sys/fs/cgroup/memory/corral/<name>``, ``/sys/fs/cgroup/pids/corral/<name>`` ...).
Every operation is a handful of small writes to cgroupfs, so the API is synchronous and
safe to call from async code.

Nothing here guesses the layout: :func:`detect` reads ``/proc/self/mountinfo`` and the
controller files, and :class:`Cgroup` reports which requested limits it could not enforce
(``unenforced``) instead of silently dropping them.

Processes should be added before they run untrusted code (e.g. spawn a helper that waits
on a pipe, :meth:`Cgroup.add` it, then let it exec): a process forks outside the group
until it has been moved in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar

from corral.backends.host import mountinfo
from corral.backends.host.threads import blocking
from corral.backends.limits import Capabilities, LimitPlan, Mechanism, Swap
from corral.errors import BackendError, BackendUnavailable

__all__ = [
    "MIN_MEMORY_BYTES",
    "Cgroup",
    "CgroupLimits",
    "CgroupStats",
    "CgroupSupport",
    "SpawnInside",
    "detect",
    "limit_capabilities",
    "prime_migration",
    "sweep_orphans",
]

PARENT = "corral"
MIN_MEMORY_BYTES = 4 * 1024 * 1024
CFS_PERIOD_US = 100_000
# The kernel refuses CFS quotas below 1 ms per period.
_MIN_QUOTA_US = 1_000
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")

# The controllers corral uses. cpuacct only exists on v1 (usage accounting; on v2 the cpu
# controller reports usage itself) and freezer only matters on v1 (v2 has cgroup.kill and
# cgroup.freeze built in).
_V1_WANTED = ("memory", "pids", "cpu", "cpuacct", "freezer")
_V2_WANTED = ("memory", "pids", "cpu")

# How long kill_all keeps trying before giving up: a frozen-then-killed task normally dies
# within milliseconds, so this bound only matters for a stuck (e.g. D-state) task.
_KILL_DEADLINE_S = 5.0
_FREEZE_DEADLINE_S = 1.0

_FIX_ROOT = (
    "run corral as root, or on a cgroup v2 host give it a delegated subtree "
    "(e.g. `systemd-run --scope -p Delegate=yes ...`), or run without resource limits"
)


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    """What to cap. ``None`` means "no limit" for that resource.

    memory_bytes: RAM (and, where the kernel accounts it, RAM+swap) in bytes, >= 4 MiB.
    cpu_quota: CPU time as a number of cores, e.g. 0.5 = half of one core, 2.0 = two cores.
    max_pids: most tasks (processes and threads) alive in the group at once.
    """

    memory_bytes: int | None = None
    cpu_quota: float | None = None
    max_pids: int | None = None

    def __post_init__(self) -> None:
        m = self.memory_bytes
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int):
                raise BackendError(f"memory limit must be an integer byte count, got {m!r}")
            if m < MIN_MEMORY_BYTES:
                # Below a few MiB even the interpreter starting the command gets OOM-killed,
                # which looks like a mysterious crash rather than a limit.
                raise BackendError(
                    f"memory limit {m} bytes is too small; it must be at least "
                    f"{MIN_MEMORY_BYTES} bytes (4 MiB)"
                )
        q = self.cpu_quota
        if q is not None:
            if isinstance(q, bool) or not isinstance(q, int | float) or not math.isfinite(q):
                raise BackendError(f"cpu quota must be a finite number of cores, got {q!r}")
            if round(q * CFS_PERIOD_US) < _MIN_QUOTA_US:
                raise BackendError(
                    f"cpu quota {q} cores is too small; it must be at least "
                    f"{_MIN_QUOTA_US / CFS_PERIOD_US} cores"
                )
        p = self.max_pids
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, int):
                raise BackendError(f"max pids must be an integer, got {p!r}")
            if p < 1:
                raise BackendError(f"max pids must be at least 1, got {p}")

    def wanted(self) -> frozenset[str]:
        """Names of the limits that are set (the CgroupLimits field names)."""
        out = set()
        if self.memory_bytes is not None:
            out.add("memory_bytes")
        if self.cpu_quota is not None:
            out.add("cpu_quota")
        if self.max_pids is not None:
            out.add("max_pids")
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """What this host offers, as found by :func:`detect` (also shown by ``corral doctor``).

    version: "v1" (legacy or hybrid), "v2" (unified) or "none".
    controllers: usable controllers among memory, pids, cpu (+ cpuacct, freezer on v1).
    root: the cgroup2 mount point (v2), the directory holding the v1 controller mounts
        (v1; informational, the real paths are in ``mounts``), or "" (none).
    reason: one sentence for humans: what was found, and if unusable why and the fix.
    mounts: v1 only: controller -> mount point of its hierarchy (co-mounted controllers,
        e.g. "cpu,cpuacct", share one path).
    """

    version: Literal["v1", "v2", "none"]
    controllers: frozenset[str]
    root: str
    reason: str
    mounts: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def usable(self) -> bool:
        return self.version != "none"


@dataclass(frozen=True, slots=True)
class CgroupStats:
    """A snapshot of a group's accounting; ``None`` where the controller is missing."""

    memory_current: int | None
    memory_peak: int | None
    oom_kills: int
    pids_current: int | None
    pids_limit_hits: int
    cpu_usage_ns: int | None


# --------------------------------------------------------------------------- detection


def _writable(path: str, mount: mountinfo.Mount) -> str | None:
    """None if we may create groups under ``path``, else why not."""
    if "ro" in mount.options:
        return f"{mount.mount_point} is mounted read-only (common inside containers)"
    if not os.access(path, os.W_OK):
        return f"no write permission on {path} (running as uid {os.geteuid()})"
    return None


def _support_v1(v1_mounts: Mapping[str, mountinfo.Mount]) -> CgroupSupport:
    usable: dict[str, str] = {}
    problems: list[str] = []
    for c, m in v1_mounts.items():
        problem = _writable(m.mount_point, m)
        if problem:
            problems.append(f"{c}: {problem}")
        else:
            usable[c] = m.mount_point
    if not usable:
        return CgroupSupport(
            "none", frozenset(), "", f"cgroup v1: {'; '.join(problems)}; {_FIX_ROOT}"
        )
    root = os.path.commonpath(list(usable.values()))
    if root in usable.values():  # a single hierarchy: report its parent directory
        root = os.path.dirname(root)
    missing = [c for c in _V1_WANTED if c not in usable]
    reason = f"cgroup v1 with controllers: {', '.join(sorted(usable))}"
    if missing:
        reason += f" (missing or unusable: {', '.join(missing)})"
    return CgroupSupport("v1", frozenset(usable), root, reason, mounts=MappingProxyType(usable))


def detect(mountinfo_path: str = "/proc/self/mountinfo") -> CgroupSupport:
    """Find which cgroup version and controllers this process can use."""
    try:
        mounts = mountinfo.read(mountinfo_path)
    except OSError as e:
        return CgroupSupport("none", frozenset(), "", f"cannot read {mountinfo_path}: {e}")

    # v1: each hierarchy's superblock options name its controllers. The first mount of a
    # hierarchy wins (later ones are usually bind mounts of the same thing).
    v1_mounts: dict[str, mountinfo.Mount] = {}
    for m in mounts:
        if m.fstype == "cgroup":
            for c in _V1_WANTED:
                if c in m.super_options and c not in v1_mounts:
                    v1_mounts[c] = m
    v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
    v2_controllers: frozenset[str] = frozenset()
    if v2_mount is not None:
        with contextlib.suppress(OSError):
            text = Path(v2_mount.mount_point, "cgroup.controllers").read_text()
            v2_controllers = frozenset(text.split()) & frozenset(_V2_WANTED)

    # A controller is bound to exactly one version; pick the version that offers more of
    # what we need (a hybrid host has an empty cgroup2 at /sys/fs/cgroup/unified).
    v1_core = {c for c in v1_mounts if c in _V2_WANTED}
    if v2_mount is not None and v2_controllers and len(v2_controllers) >= len(v1_core):
        problem = _writable(v2_mount.mount_point, v2_mount)
        if problem:
            return CgroupSupport(
                "none", frozenset(), v2_mount.mount_point, f"cgroup v2: {problem}; {_FIX_ROOT}"
            )
        found = ", ".join(sorted(v2_controllers))
        return CgroupSupport(
            "v2",
            v2_controllers,
            v2_mount.mount_point,
            f"cgroup v2 at {v2_mount.mount_point} with controllers: {found}",
        )
    if v1_mounts:
        return _support_v1(v1_mounts)
    if v2_mount is not None:
        return CgroupSupport(
            "none",
            frozenset(),
            v2_mount.mount_point,
            f"cgroup v2 at {v2_mount.mount_point} offers none of memory, pids, cpu "
            "(enable them in the parent's cgroup.subtree_control, or boot with "
            "systemd.unified_cgroup_hierarchy=1)",
        )
    return CgroupSupport(
        "none", frozenset(), "", "no cgroup filesystem is mounted (mount cgroup2 on /sys/fs/cgroup)"
    )


# --------------------------------------------------------------------------- file helpers


def _write(path: Path, value: str) -> None:
    # One write() per value: cgroupfs parses each write as a whole, and buffered text I/O
    # could split or merge them.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _read_key(path: Path, key: str) -> int | None:
    """The integer after ``key`` in a flat-keyed file (memory.events, cpu.stat, ...)."""
    text = _read(path)
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            with contextlib.suppress(ValueError):
                return int(parts[1])
    return None


def _backoff() -> Iterator[float]:
    """Pauses between polls of a dying group: 0.1 ms doubling to 5 ms. Killed tasks leave
    within a millisecond or so, but a namespace teardown can take several; cgroup v1 has no
    event to wait on."""
    delay = 0.0001
    while True:
        yield delay
        delay = min(delay * 2, 0.005)


def _read_pids(path: Path) -> set[int]:
    text = _read(path / "cgroup.procs")
    return {int(p) for p in text.split()} if text else set()


def _check_name(name: str) -> None:
    # The name becomes a directory name: no separators, no dot-dirs, nothing a shell or
    # the kernel would treat specially.
    if not _NAME_RE.fullmatch(name):
        raise BackendError(
            f"invalid cgroup name {name!r}: use 1-100 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-'"
        )


def limit_capabilities(support: CgroupSupport, own_pids: int = 0) -> Capabilities:
    """What a box's cgroup on this host can enforce, for the limits planner."""
    if support.version == "none":
        return Capabilities("none", frozenset(), "inactive", own_pids, reason=support.reason)
    if support.version == "v1":
        mount = support.mounts.get("memory")
        capped = mount is not None and Path(mount, "memory.memsw.limit_in_bytes").exists()
    else:  # the file exists in any group once the kernel accounts swap
        capped = next(Path(support.root).glob("*/memory.swap.max"), None) is not None
    swap: Swap = "capped" if capped else "uncapped" if _swap_active() else "inactive"
    controllers = support.controllers & {"memory", "cpu", "pids"}
    mechanism: Mechanism = "cgroup v1" if support.version == "v1" else "cgroup v2"
    return Capabilities(mechanism, controllers, swap, own_pids)


def late_unenforced(group: Cgroup, plan: LimitPlan) -> list[str]:
    """Limits the plan expected to hold but the group could not take (a v2 controller the
    parent refused to delegate), named as the planner names them."""
    return [
        f"limits.{name} not enforced: its controller could not be enabled for {group.name}"
        for name in sorted(group.unenforced - {"swap"} - plan.unenforced)
    ]


def prime_migration(support: CgroupSupport, started: threading.Event | None = None) -> None:
    """Start the RCU grace period that the next move of a process between cgroups waits for,
    so that it passes while the caller does other work. Blocking (a thread's job).

    Moving a task takes the kernel's global ``cgroup_threadgroup_rwsem`` for writing, and the
    first writer after a quiet spell waits one RCU grace period (about 10 ms here, measured:
    0.05 ms for a second move right after). This thread re-adds itself to the group it is
    already in (the v1 ``tasks`` file, or the process to its own v2 group): no task changes
    group, but the grace period starts now, and a move made while it runs or just after it
    does not wait again.

    ``started`` is set just before that write (or when there is nothing to write): a caller
    that has more Python work to do waits for it, so the write is not held back by the GIL.
    """
    try:
        found = _own_group(support)
    finally:
        if started is not None:
            started.set()
    if found is not None:
        with contextlib.suppress(OSError):
            _write(*found)


def _own_group(support: CgroupSupport) -> tuple[Path, str] | None:
    """The file that adds this thread (v1) or process (v2) to its own group, and the id."""
    try:
        own = Path("/proc/thread-self/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in own:
        _, controllers, where = line.split(":", 2)
        for name in controllers.split(","):
            paths[name] = where
    if any(".." in where.split("/") for where in paths.values()):
        return None  # outside our cgroup namespace's view: nothing to re-add to
    if support.version == "v1":
        usable = [c for c in _V1_WANTED if c in support.mounts and c in paths]
        if not usable:
            return None
        target = Path(support.mounts[usable[0]], paths[usable[0]].lstrip("/"), "tasks")
        return target, str(threading.get_native_id())
    if support.version == "v2" and "" in paths:
        return Path(support.root, paths[""].lstrip("/"), "cgroup.procs"), str(os.getpid())
    return None


_T = TypeVar("_T")


class SpawnInside:
    """Start a process inside a group rather than moving it there (cgroup v1).

    A process moved between groups takes the kernel's ``cgroup_threadgroup_rwsem`` for
    writing, and the first writer after a quiet spell waits an RCU grace period (~8 ms here,
    on the path of every box start). A thread that moves *itself* (``0`` written to a v1
    ``tasks`` file) skips that lock. So one host thread of corral's moves itself into the
    group (0.1 ms per hierarchy), runs ``start`` (which forks the process: born inside), and
    moves itself back. It is never the main thread: memory is charged to the cgroup of a
    process's main thread, so the host's own memory is never charged to a box.

    A thread that cannot move back is retired (it leaves the group when it exits) and the
    spawner is marked unusable: callers then move their process the usual way."""

    def __init__(self, support: CgroupSupport) -> None:
        self._support = support
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.unusable: str | None = None if support.version == "v1" else "not cgroup v1"

    def submit(self, group: Cgroup, start: Callable[[], _T]) -> Future[_T]:
        """``start()`` in the spawner's thread while it is in ``group`` in every hierarchy;
        an OSError if the thread could not enter (``start`` did not run)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="corral-spawn")
            pool = self._pool
        return pool.submit(self._inside, group, start)

    def _homes(self, group: Cgroup) -> dict[Path, Path]:
        """Each of ``group``'s v1 directories -> the ``tasks`` file of this thread's own
        group in that hierarchy."""
        own: dict[str, str] = {}
        for line in Path("/proc/thread-self/cgroup").read_text().splitlines():
            _, controllers, at = line.split(":", 2)
            for name in controllers.split(","):
                own[name] = at
        homes: dict[Path, Path] = {}
        for controller, directory in group.paths.items():
            home = own.get(controller)
            mount = self._support.mounts.get(controller)
            if home is None or mount is None or ".." in home.split("/"):
                raise OSError(errno.ENOENT, f"no own {controller} group to come back to")
            homes[directory] = Path(mount, home.lstrip("/"), "tasks")
        return homes

    def _inside(self, group: Cgroup, start: Callable[[], _T]) -> _T:
        homes = self._homes(group)
        entered: list[Path] = []
        try:
            for directory in homes:
                _write(directory / "tasks", "0")
                entered.append(directory)
            return start()
        finally:
            try:
                for directory in entered:
                    _write(homes[directory], "0")
            except OSError as exc:
                self._retire(f"the spawner thread could not leave {group.name}: {exc}")

    def _retire(self, why: str) -> None:
        with self._lock:
            self.unusable = why
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # its thread exits after this job
            self._pool = None

    def holds(self, group: Cgroup, pid: int) -> bool:
        """Whether process ``pid`` is in ``group`` in every hierarchy of the group."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return False
        where: dict[str, str] = {}
        for line in lines:
            _, controllers, at = line.split(":", 2)
            for name in controllers.split(","):
                where[name] = at
        for controller, directory in group.paths.items():
            mount = self._support.mounts.get(controller)
            found = where.get(controller)
            if mount is None or found is None or Path(mount, found.lstrip("/")) != directory:
                return False
        return True


def _swap_active() -> bool:
    text = _read(Path("/proc/swaps"))
    return bool(text and len(text.strip().splitlines()) > 1)


def _unavailable_or_error(e: OSError, path: Path, what: str) -> BackendError:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return BackendUnavailable(f"cannot {what} {path}: {e.strerror}; {_FIX_ROOT}")
    return BackendError(f"cannot {what} {path}: {e.strerror}")


# --------------------------------------------------------------------------- the group


class Cgroup:
    """One sandbox's control group (one directory per v1 hierarchy, or one v2 directory)."""

    __slots__ = ("_counters", "_dirs", "limits", "name", "support", "unenforced", "version")

    def __init__(
        self,
        name: str,
        version: Literal["v1", "v2"],
        dirs: Mapping[str, Path],
        limits: CgroupLimits,
        support: CgroupSupport,
        unenforced: frozenset[str] = frozenset(),
    ) -> None:
        """Wrap existing directories; use :meth:`create` to make a new group."""
        self.name = name
        self.version = version
        # v1: controller -> directory, co-mounted controllers share one. v2: {"": dir}.
        self._dirs = MappingProxyType(dict(dirs))
        self.limits = limits
        self.support = support
        # CgroupLimits field names (memory_bytes, cpu_quota, max_pids) that were asked
        # for but are not enforced, plus "swap" when memory is capped but swap is active
        # and cannot be capped (so the process could page out past the limit).
        self.unenforced = unenforced
        self._counters: dict[str, int] = {}
        """Counter ("oom", "pids") -> a descriptor kept open on its file (:meth:`_count`)."""

    def __del__(self) -> None:
        self.close_counters()

    # ---- creation

    @classmethod
    def create(
        cls, name: str, limits: CgroupLimits, support: CgroupSupport | None = None
    ) -> Cgroup:
        """Make ``corral/<name>`` and apply ``limits``; the name must not exist yet."""
        _check_name(name)
        if support is None:
            support = detect()
        if support.version == "none":
            raise BackendUnavailable(f"cgroups are not usable: {support.reason}")
        if support.version == "v2":
            return cls._create_v2(name, limits, support)
        return cls._create_v1(name, limits, support)

    @classmethod
    def _create_v1(cls, name: str, limits: CgroupLimits, support: CgroupSupport) -> Cgroup:
        # Make the group in every usable hierarchy, not just those with a limit set:
        # cpuacct gives usage, freezer makes kill_all race-free, memory/pids give stats.
        dirs: dict[str, Path] = {}
        made: list[Path] = []
        try:
            for c in _V1_WANTED:
                mount = support.mounts.get(c)
                if mount is None:
                    continue
                d = Path(mount, PARENT, name)
                if d not in made:
                    _mkdir_group(d)
                    made.append(d)
                dirs[c] = d
            group = cls(name, "v1", dirs, limits, support)
            group.unenforced = group._apply_v1(limits)
        except BaseException:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return group

    def _apply_v1(self, limits: CgroupLimits) -> frozenset[str]:
        unenforced: set[str] = set()
        if limits.memory_bytes is not None:
            d = self._dirs.get("memory")
            if d is None:
                unenforced.add("memory_bytes")
            else:
                value = str(limits.memory_bytes)
                # RAM first: memsw must never be below the RAM limit, so it is set second.
                self._set(d / "memory.limit_in_bytes", value)
                if (d / "memory.memsw.limit_in_bytes").exists():
                    self._set(d / "memory.memsw.limit_in_bytes", value)
                elif _swap_active():
                    unenforced.add("swap")
                # Best effort: keeps the group from swapping before it hits the cap.
                with contextlib.suppress(OSError):
                    _write(d / "memory.swappiness", "0")
                # The default, stated explicitly: OOM inside the group kills inside it.
                with contextlib.suppress(OSError):
                    _write(d / "memory.oom_control", "0")
        if limits.max_pids is not None:
            d = self._dirs.get("pids")
            if d is None:
                unenforced.add("max_pids")
            else:
                self._set(d / "pids.max", str(limits.max_pids))
        if limits.cpu_quota is not None:
            d = self._dirs.get("cpu")
            if d is None:
                unenforced.add("cpu_quota")
            else:
                self._set(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                self._set(d / "cpu.cfs_quota_us", str(round(limits.cpu_quota * CFS_PERIOD_US)))
        return frozenset(unenforced)

    @classmethod
    def _create_v2(cls, name: str, limits: CgroupLimits, support: CgroupSupport) -> Cgroup:
        root = Path(support.root)
        parent = root / PARENT
        want = [c for c in _V2_WANTED if c in support.controllers]
        # Controllers flow down: the root must delegate them to corral/, and corral/ to
        # each sandbox. The root is exempt from the no-internal-processes rule, and
        # corral/ never holds processes itself, so both writes are allowed.
        enabled = _enable_controllers(root, want)
        try:
            _mkdir(parent)
        except FileExistsError:
            pass
        except OSError as e:
            raise _unavailable_or_error(e, parent, "create") from e
        enabled = _enable_controllers(parent, [c for c in want if c in enabled])
        d = parent / name
        _mkdir_group(d)
        try:
            group = cls(name, "v2", {"": d}, limits, support)
            group.unenforced = group._apply_v2(limits, enabled)
        except BaseException:
            with contextlib.suppress(OSError):
                d.rmdir()
            raise
        return group

    def _apply_v2(self, limits: CgroupLimits, enabled: set[str]) -> frozenset[str]:
        d = self._dirs[""]
        unenforced: set[str] = set()
        if limits.memory_bytes is not None:
            if "memory" not in enabled:
                unenforced.add("memory_bytes")
            else:
                self._set(d / "memory.max", str(limits.memory_bytes))
                # v2 accounts swap separately: forbid it so it cannot extend the cap.
                if (d / "memory.swap.max").exists():
                    self._set(d / "memory.swap.max", "0")
                elif _swap_active():
                    unenforced.add("swap")
        if limits.max_pids is not None:
            if "pids" not in enabled:
                unenforced.add("max_pids")
            else:
                self._set(d / "pids.max", str(limits.max_pids))
        if limits.cpu_quota is not None:
            if "cpu" not in enabled:
                unenforced.add("cpu_quota")
            else:
                quota = round(limits.cpu_quota * CFS_PERIOD_US)
                self._set(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")
        return frozenset(unenforced)

    def _set(self, path: Path, value: str) -> None:
        try:
            _write(path, value)
        except OSError as e:
            raise BackendError(
                f"cannot set {path.name}={value} for cgroup {self.name!r} ({path}): {e.strerror}"
            ) from e

    # ---- introspection

    @property
    def paths(self) -> Mapping[str, Path]:
        """Controller -> directory (v1), or {"": directory} (v2)."""
        return self._dirs

    @property
    def path(self) -> Path:
        """The main directory: the v2 group, or the v1 memory (else first) group."""
        if "" in self._dirs:
            return self._dirs[""]
        return self._dirs.get("memory") or next(iter(self._dirs.values()))

    def _unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self._dirs.values()))

    def __repr__(self) -> str:
        extra = f", unenforced={sorted(self.unenforced)}" if self.unenforced else ""
        return f"Cgroup({self.name!r}, {self.version}, path={str(self.path)!r}{extra})"

    # ---- processes

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group in every hierarchy."""
        for d in self._unique_dirs():
            try:
                _write(d / "cgroup.procs", str(pid))
            except OSError as e:
                if e.errno == errno.ESRCH:
                    raise BackendError(f"cannot add pid {pid} to {self!r}: no such process") from e
                raise BackendError(f"cannot add pid {pid} to {d}: {e.strerror}") from e

    def pids(self) -> list[int]:
        """Sorted pids of the processes in the group (union over hierarchies)."""
        out: set[int] = set()
        for d in self._unique_dirs():
            out |= _read_pids(d)
        return sorted(out)

    def kill_all(self, *, wait: bool = True) -> None:
        """SIGKILL every process in the group; returns once it is empty (``wait``), or once
        every process has the signal pending: none of them runs user code again.

        Blocking (it polls with ``time.sleep``): from a coroutine use :meth:`kill_all_async`.
        Raises BackendError if processes survive for several seconds (e.g. stuck in
        uninterruptible I/O).
        """
        for pause in self._kill_steps(wait):
            time.sleep(pause)

    async def kill_all_async(self, *, wait: bool = True) -> None:
        """:meth:`kill_all` for the event loop: its polls wait with ``asyncio.sleep``."""
        for pause in self._kill_steps(wait):
            await asyncio.sleep(pause)

    async def freeze_async(self, frozen: bool, *, deadline: float = _FREEZE_DEADLINE_S) -> bool:
        """Freeze (or thaw) every process of the group: frozen ones do not run until thawed,
        and new ones cannot start. False when the host has no freezer for it, or the freeze
        did not settle within ``deadline`` seconds."""
        steps = self._freeze(frozen, deadline)
        try:
            for _ in range(1 << 20):  # the steps end within the deadline
                await asyncio.sleep(next(steps))
        except StopIteration as done:
            return bool(done.value)
        return False

    def _kill_steps(self, wait: bool) -> Iterator[float]:
        """The kill as steps (sans I/O of its own waiting): each yielded value is how long
        the driver pauses before the next poll."""
        d2 = self._dirs.get("")
        if d2 is not None and (d2 / "cgroup.kill").exists():
            # The kernel kills the whole group atomically, racing forks included.
            with contextlib.suppress(FileNotFoundError):
                _write(d2 / "cgroup.kill", "1")
            if wait:
                yield from self._wait_empty()
            return
        deadline = time.monotonic() + _KILL_DEADLINE_S
        pauses = _backoff()
        while self.pids():
            # Frozen tasks cannot fork, so one pass over cgroup.procs gets them all; the
            # kill is delivered once they thaw. Without a freezer we loop until forks stop.
            frozen = yield from self._freeze(True)
            try:
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            finally:
                # Never leave the group frozen (or half frozen): SIGKILL is only acted on
                # once thawed.
                yield from self._freeze(False)
            if time.monotonic() > deadline:
                raise BackendError(
                    f"processes {self.pids()} in {self!r} survived SIGKILL for "
                    f"{_KILL_DEADLINE_S:.0f} s"
                )
            if not wait and frozen:
                return  # all were frozen, so none forked: each has its SIGKILL pending
            yield next(pauses)

    def _wait_empty(self) -> Iterator[float]:
        deadline = time.monotonic() + _KILL_DEADLINE_S
        pauses = _backoff()
        while self.pids():
            if time.monotonic() > deadline:
                raise BackendError(f"processes {self.pids()} in {self!r} survived cgroup.kill")
            yield next(pauses)

    def thaw_write(self) -> tuple[Path, str] | None:
        """The write that thaws the group (file and value), for a process other than this
        one to make (see ``backends.base.ThawGuard``); None without a freezer."""
        d2 = self._dirs.get("")
        if d2 is not None:
            return d2 / "cgroup.freeze", "0"
        if "freezer" in self._dirs:
            return self._dirs["freezer"] / "freezer.state", "THAWED"
        return None

    def _freeze(
        self, frozen: bool, deadline_s: float = _FREEZE_DEADLINE_S
    ) -> Generator[float, None, bool]:
        """Freeze/thaw the group; False if there is no way to (no freezer), or a freeze did
        not settle within ``deadline_s``."""
        d2 = self._dirs.get("")
        if d2 is not None:
            path, value = d2 / "cgroup.freeze", ("1" if frozen else "0")
        elif "freezer" in self._dirs:
            path = self._dirs["freezer"] / "freezer.state"
            value = "FROZEN" if frozen else "THAWED"
        else:
            return False
        try:
            _write(path, value)
        except OSError:
            return False
        if frozen and "freezer" in self._dirs:
            # v1 freezing is asynchronous (FREEZING until every task has stopped); a task
            # still running could fork after we listed the pids. The kernel tries each task
            # once per write: a task it could not stop (in a syscall that was restarting, or
            # just forked) is tried again only when FROZEN is written again.
            deadline = time.monotonic() + deadline_s
            pauses = _backoff()
            while (_read(path) or "").strip() != "FROZEN":
                if time.monotonic() > deadline:
                    return False  # not every task stopped: the caller must not rely on it
                yield next(pauses)
                with contextlib.suppress(OSError):
                    _write(path, value)
        return True

    # ---- accounting

    def oom_kills(self) -> int:
        """How many processes the memory limit killed (``run`` reads it twice)."""
        return self._count("oom", b"oom_kill")

    def pids_limit_hits(self) -> int:
        """How many forks the pids limit refused (``run`` reads it twice)."""
        return self._count("pids", b"max")

    def _counter_file(self, which: str) -> Path | None:
        if which == "oom":
            if self.version == "v2":
                return self._dirs[""] / "memory.events"
            mem = self._dirs.get("memory")
            return mem / "memory.oom_control" if mem else None
        d = self._dirs[""] if self.version == "v2" else self._dirs.get("pids")
        return d / "pids.events" if d else None

    def _count(self, which: str, key: bytes) -> int:
        """The integer after ``key`` in the flat-keyed counter file ``which`` names (0 if
        none), read through a descriptor kept open: a read at offset 0 makes the kernel
        write the file anew. ``run`` reads two counters before and after every command; an
        open, read and close through pathlib took ~100 us each here, a ``pread`` ~3 us."""
        fd = self._counters.get(which)
        if fd is None:
            path = self._counter_file(which)
            if path is None:
                return 0
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return 0
            kept = self._counters.setdefault(which, fd)
            if kept != fd:  # another thread opened it meanwhile
                os.close(fd)
                fd = kept
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            return 0
        for line in data.splitlines():
            name, _, value = line.partition(b" ")
            if name == key:
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    def close_counters(self) -> None:
        """Close the descriptors :meth:`_count` keeps (:meth:`remove` does)."""
        counters = getattr(self, "_counters", None)
        while counters:
            _, fd = counters.popitem()
            with contextlib.suppress(OSError):
                os.close(fd)

    def stats(self) -> CgroupStats:
        if self.version == "v2":
            d = self._dirs[""]
            usage_us = _read_key(d / "cpu.stat", "usage_usec")
            return CgroupStats(
                memory_current=_read_int(d / "memory.current"),
                memory_peak=_read_int(d / "memory.peak"),
                oom_kills=self.oom_kills(),
                pids_current=_read_int(d / "pids.current"),
                pids_limit_hits=self.pids_limit_hits(),
                cpu_usage_ns=None if usage_us is None else usage_us * 1000,
            )
        mem = self._dirs.get("memory")
        pids = self._dirs.get("pids")
        acct = self._dirs.get("cpuacct")
        return CgroupStats(
            memory_current=_read_int(mem / "memory.usage_in_bytes") if mem else None,
            memory_peak=_read_int(mem / "memory.max_usage_in_bytes") if mem else None,
            oom_kills=self.oom_kills(),
            pids_current=_read_int(pids / "pids.current") if pids else None,
            pids_limit_hits=self.pids_limit_hits(),
            cpu_usage_ns=_read_int(acct / "cpuacct.usage") if acct else None,
        )

    # ---- teardown

    def remove(self) -> None:
        """Kill everything inside, then delete the group's directories. Idempotent.

        Blocking: from a coroutine use :meth:`remove_async`."""
        self.close_counters()
        for pause in self._remove_steps():
            time.sleep(pause)

    async def remove_async(self) -> None:
        """:meth:`remove` for the event loop: the kill's polls wait with ``asyncio.sleep``,
        the ``rmdir`` calls (a grace period each on cgroup v1) run in a thread."""
        await self.kill_all_async()
        await blocking(self.remove)  # empty by now: no polling left in there

    def _remove_steps(self) -> Iterator[float]:
        dirs = [d for d in self._unique_dirs() if d.exists()]
        if not dirs:
            return
        yield from self._kill_steps(True)
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.EBUSY:
                    # A process slipped in after kill_all (someone else's add): retry once.
                    yield from self._kill_steps(True)
                    try:
                        d.rmdir()
                    except FileNotFoundError:
                        continue
                    except OSError as e2:
                        raise BackendError(f"cannot remove {d}: {e2.strerror}") from e2
                    continue
                raise BackendError(f"cannot remove {d}: {e.strerror}") from e


def _mkdir(d: Path) -> None:
    # The one place directories are made (the kernel populates them with interface files).
    os.mkdir(d)


def _mkdir_group(d: Path) -> None:
    """Make the group ``d`` (and its parent, ``corral/``, the first time): the group first,
    the parent only when the kernel says it is missing. Trying the parent every time was a
    failing mkdir per hierarchy on every box start (five here, ~0.2 ms)."""
    try:
        _mkdir(d)
        return
    except FileNotFoundError:
        pass
    except FileExistsError as e:
        raise _exists(d) from e
    except OSError as e:
        raise _unavailable_or_error(e, d, "create") from e
    try:
        _mkdir(d.parent)
    except FileExistsError:
        pass  # made by another start meanwhile
    except OSError as e:
        raise _unavailable_or_error(e, d.parent, "create") from e
    try:
        _mkdir(d)
    except FileExistsError as e:
        raise _exists(d) from e
    except OSError as e:
        raise _unavailable_or_error(e, d, "create") from e


def _exists(d: Path) -> BackendError:
    return BackendError(
        f"cgroup {d} already exists: another sandbox uses the name {d.name!r}, or a "
        "previous run crashed (sweep_orphans() removes such leftovers)"
    )


def _enable_controllers(d: Path, want: Iterable[str]) -> set[str]:
    """Enable each wanted controller for d's children; returns those now enabled."""
    text = _read(d / "cgroup.subtree_control") or ""
    enabled = set(text.split())
    for c in want:
        if c in enabled:
            continue
        # One write per controller so a refusal of one (e.g. EBUSY for cpu when a
        # realtime task is about) does not lose the others.
        with contextlib.suppress(OSError):
            _write(d / "cgroup.subtree_control", f"+{c}")
            enabled.add(c)
    return enabled


# --------------------------------------------------------------------------- orphans


def _parent_dirs(support: CgroupSupport) -> Iterator[tuple[str, Path]]:
    if support.version == "v2":
        yield "", Path(support.root, PARENT)
    elif support.version == "v1":
        seen: set[str] = set()
        for c, mount in support.mounts.items():
            if mount not in seen:
                seen.add(mount)
                yield c, Path(mount, PARENT)


def sweep_orphans(
    is_alive: Callable[[str], bool], support: CgroupSupport | None = None
) -> list[str]:
    """Remove ``corral/<name>`` groups whose owner ``is_alive(name)`` says is gone.

    Meant for start-up after a host crash left groups behind; killing their processes is
    part of removing them. Returns the removed names, sorted.
    """
    if support is None:
        support = detect()
    if support.version == "none":
        return []
    version: Literal["v1", "v2"] = support.version
    found: dict[str, dict[str, Path]] = {}
    for controller, parent in _parent_dirs(support):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir() and _NAME_RE.fullmatch(entry.name):
                found.setdefault(entry.name, {})[controller] = entry
    # Co-mounted v1 controllers: map every controller sharing a mount to the same dir.
    removed = []
    for name, dirs in sorted(found.items()):
        if is_alive(name):
            continue
        if version == "v1":
            for c, mount in support.mounts.items():
                p = Path(mount, PARENT, name)
                if p.is_dir():
                    dirs[c] = p
        Cgroup(name, version, dirs, CgroupLimits(), support).remove()
        removed.append(name)
    return removed


# --------------------------------------------------------------------------- delegation


def rootless_limits(own_pids: int = 0) -> tuple[CgroupSupport | None, Capabilities]:
    """How an ordinary user's boxes are limited: a group each in its delegated cgroup v2
    subtree (:func:`delegated_v2`) with the controllers it offers, and rlimits for what no
    controller enforces; without a subtree, rlimits alone (``NO_CGROUP``)."""
    from corral.backends.host.subids import NO_CGROUP

    support = delegated_v2()
    if support is None:
        return None, Capabilities("rlimits", controllers=frozenset(), reason=NO_CGROUP)
    if not support.controllers:  # a group for the box (accounting, kill), limits as rlimits
        reason = f"{support.reason}: none of memory, pids, cpu to enforce them"
        return support, Capabilities("rlimits", controllers=frozenset(), reason=reason)
    found = limit_capabilities(support, own_pids=own_pids)
    return support, dataclasses.replace(found, rlimit_fallback=True, reason=support.reason)


def delegated_v2(
    mountinfo_path: str = "/proc/self/mountinfo", self_cgroup: str = "/proc/self/cgroup"
) -> CgroupSupport | None:
    """A cgroup v2 subtree delegated to this (unprivileged) user, or None.

    Delegated means the user may write its ``cgroup.procs`` and ``cgroup.subtree_control``:
    ``CORRAL_CGROUP_DELEGATE`` names one (a group root made and chowned to the user, holding
    this process in a child group), else this process's own group is used when it is the
    user's (``systemd-run --user --scope -p Delegate=yes``). Boxes' groups go beneath it
    (``<root>/corral/<box>``): moving a process between two groups needs write access to
    their common ancestor's ``cgroup.procs``, which is the user's. The controllers are those
    the subtree can give its children: all it offers when this process is not in the root
    itself, else only those already enabled there (the kernel refuses to enable one in a
    group that holds processes). A hybrid host's v2 hierarchy may offer none of memory, pids
    and cpu: what is missing falls back to rlimits."""
    try:
        mounts = mountinfo.read(mountinfo_path)
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    v2_mount = next((m for m in mounts if m.fstype == "cgroup2"), None)
    own_rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if v2_mount is None or own_rel is None or "ro" in v2_mount.options:
        return None
    own = Path(v2_mount.mount_point, own_rel.lstrip("/"))
    explicit = os.environ.get("CORRAL_CGROUP_DELEGATE")
    d = Path(explicit) if explicit else own
    files = (d, d / "cgroup.procs", d / "cgroup.subtree_control")
    if not all(os.access(f, os.W_OK) for f in files):
        return None
    if not own.is_relative_to(d):
        return None  # the move into a box's group needs write access to a common ancestor
    if d != own:
        offered = set((_read(d / "cgroup.controllers") or "").split())
    else:
        offered = set((_read(d / "cgroup.subtree_control") or "").split())
    controllers = frozenset(offered) & frozenset(_V2_WANTED)
    found = ", ".join(sorted(controllers)) or "no controllers"
    return CgroupSupport("v2", controllers, str(d), f"delegated cgroup v2 at {d} ({found})")
