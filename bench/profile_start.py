"""Where a cold bwrap box's start goes: each step's wall and CPU time, and each box process's.

    python bench/profile_start.py [--runs N] [--timeline]

A developer's tool, not a benchmark: it wraps the bwrap backend's start-up steps (private
functions, so it follows their names) and prints, for the p50 of ``--runs`` starts:

- each step's wall time and the CPU time of the thread that ran it (``time.thread_time``);
  steps in threads (the prepare step, the cgroup prime, the devpts mount) overlap the
  loop's;
- the CPU each box process had used when ``start()`` returned, from ``/proc/PID/schedstat``
  (bwrap's monitor, bwrap's init = the box's pid 1, the guest agent);
- with ``--timeline``, the steps of the last start on one time axis (ms from the call).

CPU times are what to compare on a busy machine: wall times there measure the other work.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from corral import Sandbox
from corral import channel as channel_mod
from corral import sandbox as sandbox_mod
from corral.backends.bwrap import args as bwrap_args
from corral.backends.bwrap import box as bwrap_box
from corral.backends.host import cgroups, devpts, idmap, seccomp

SPANS: dict[str, list[tuple[float, float]]] = defaultdict(list)
"""Step -> (wall seconds, CPU seconds of its thread), one per call."""
MARKS: list[tuple[str, float, float, str]] = []
"""(step, start, end, thread) of the current start, seconds from its call."""
T0 = [0.0]


def _record(name: str, start: float, cpu: float, thread: str) -> None:
    end = time.perf_counter()
    SPANS[name].append((end - start, cpu))
    MARKS.append((name, start - T0[0], end - T0[0], thread))


def wrap(owner: Any, attr: str, name: str | None = None) -> None:
    """Time ``owner.attr`` (a function or a coroutine function) on every call."""
    fn = getattr(owner, attr)
    label = name or attr
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _record(label, start, 0.0, "loop")

        setattr(owner, attr, timed_async)
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _record(label, start, time.thread_time() - cpu, threading.current_thread().name)

    setattr(owner, attr, timed)


def instrument() -> None:
    backend = bwrap_box.BwrapBackend
    for owner, attr, name in (
        (sandbox_mod, "_check_host_paths", None),
        (seccomp, "build_filter", None),
        (backend, "_make_cgroup", None),
        (cgroups, "prime_migration", None),
        (bwrap_box, "shared_files", None),
        (idmap, "share_paths", None),
        (bwrap_args, "bwrap_argv", None),
        (backend, "_prepare_box", None),
        (backend, "_spawn", None),
        (bwrap_box, "_read_info", None),
        (bwrap_box, "_setup_box_ids", None),
        (devpts, "_mount", "devpts mount"),
        (cgroups.Cgroup, "add", "cgroup move"),
        (backend, "start", "backend.start"),
        (channel_mod.Channel, "wait_ready", "agent ready"),
    ):
        if hasattr(owner, attr):  # the steps change as the code does
            wrap(owner, attr, name)


def schedstat_ms(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def box_cpu(sb: Sandbox) -> dict[str, float]:
    """CPU used so far by the box's processes (bwrap's monitor, its init, the agent)."""
    out: dict[str, float] = {}
    monitor = getattr(getattr(sb, "_box", None), "_proc", None)
    if monitor is None:
        return out
    out["bwrap monitor"] = schedstat_ms(monitor.pid)
    for init in children(monitor.pid)[:1]:
        out["bwrap init (pid 1)"] = schedstat_ms(init)
        for agent in children(init)[:1]:
            out["guest agent"] = schedstat_ms(agent)
    return out


async def main(runs: int, timeline: bool) -> None:
    instrument()
    total: list[float] = []
    host_cpu: list[float] = []
    procs: dict[str, list[float]] = defaultdict(list)
    warmup = 2
    for i in range(runs + warmup):
        MARKS.clear()
        sb = Sandbox()
        T0[0] = start = time.perf_counter()
        cpu = time.process_time()
        await sb.start()
        elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        if i >= warmup:
            total.append(elapsed * 1000)
            host_cpu.append(used * 1000)
            for name, ms in box_cpu(sb).items():
                procs[name].append(ms)
        await sb.aclose()
    print(
        f"create-to-ready p50 {statistics.median(total):.2f} ms, min {min(total):.2f} ms "
        f"({runs} starts; load average {os.getloadavg()[0]:.2f})"
    )
    print(f"  {'host process CPU':<24} p50 {statistics.median(host_cpu):6.2f} ms")
    for name, values in procs.items():
        print(f"  {name + ' CPU':<24} p50 {statistics.median(values):6.2f} ms")
    print("steps (p50)")
    for name, calls in SPANS.items():
        kept = calls[warmup:] or calls
        wall = statistics.median(c[0] for c in kept) * 1000
        cpu_ms = statistics.median(c[1] for c in kept) * 1000
        print(f"  {name:<24} wall {wall:6.2f} ms   thread CPU {cpu_ms:6.2f} ms")
    if timeline:
        print("timeline of the last start (ms from the call)")
        for name, begin, end, thread in sorted(MARKS, key=lambda m: m[1]):
            print(f"  {name:<24} {begin * 1000:7.2f} -> {end * 1000:7.2f}   [{thread}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--timeline", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.timeline))
