"""One time axis for a cold bwrap box's start: the host's steps and what bwrap and the agent do.

    python bench/start_timeline.py [--runs N]        (root, with perf installed)

A developer's tool, like ``bench/profile_start.py`` (whose step wrappers it uses for the
host's side). It runs itself under ``perf record -a -k mono`` with a few scheduler and
syscall tracepoints, so the box's own processes appear on the same clock as the host's
steps, and prints the median over ``--runs`` starts of, in ms from the ``start()`` call:

- each host step (start -> end, the thread it ran in);
- the box's processes: the id-dropping helper's and bwrap's execs, bwrap's clone of the
  box's first process (the namespaces), that process's first mount and last
  ``pivot_root`` (the mounts), its fork and the agent's exec, and "ready";
- the CPU each kind of process was on a core inside the window (``sched_switch``): on a
  busy machine the wall clock measures the other load, the CPU much less so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

EVENTS = (
    "sched:sched_process_fork",
    "sched:sched_process_exec",
    "sched:sched_switch",
    "syscalls:sys_enter_mount",
    "syscalls:sys_enter_pivot_root",
)
_LINE = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")


async def starts(runs: int, out: Path) -> None:
    """The measured process: ``runs`` starts (after two to warm up), their windows and the
    host steps of each, written to ``out``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import profile_start  # the host steps' wrappers (perf_counter is CLOCK_MONOTONIC)

    from corral import Sandbox

    profile_start.instrument()
    found = []
    for i in range(runs + 2):
        profile_start.MARKS.clear()
        sb = Sandbox()
        profile_start.T0[0] = t0 = time.perf_counter()
        await sb.start()
        t1 = time.perf_counter()
        if i >= 2:
            found.append(
                {"t0": t0, "t1": t1, "host": list(profile_start.MARKS), "pid": os.getpid()}
            )
        await sb.aclose()
        await asyncio.sleep(0.02)  # the teardown's own work outside the next window
    out.write_text(json.dumps(found))


def parse(perf_text: str) -> list[tuple[float, str, int, int, str, str]]:
    events = []
    for line in perf_text.splitlines():
        m = _LINE.match(line)
        if m:
            comm, pid, _, cpu, at, name, rest = m.groups()
            events.append((float(at), comm, int(pid), int(cpu), name, rest))
    events.sort()
    return events


def box_steps(window: list[tuple[float, str, int, int, str, str]], t0: float) -> dict[str, float]:
    """The box processes' events of one start, ms from ``t0``."""
    steps: dict[str, float] = {}

    def at(name: str, when: float) -> None:
        steps.setdefault(name, (when - t0) * 1000)

    child = agent = -1
    for when, comm, pid, _, name, rest in window:
        if name == "sched:sched_process_exec":
            exe = rest.split("filename=")[-1].split()[0]
            if exe.endswith(("/unshare", "/setpriv")):
                at("id-dropping helper exec", when)
            elif exe.endswith("/bwrap"):
                at("bwrap exec", when)
            elif "/python" in exe and child > 0:
                agent = pid
                at("agent exec", when)
        elif name == "sched:sched_process_fork" and comm == "bwrap":
            forked = int(rest.split("child_pid=")[-1].split()[0])
            if child < 0:
                child = forked
                at("bwrap clone: the box's namespaces", when)
            elif pid == child:
                at("box init forks the agent", when)
        elif name == "syscalls:sys_enter_mount" and pid == child:
            at("first mount", when)
        elif name == "syscalls:sys_enter_pivot_root" and pid == child:
            steps["last pivot_root"] = (when - t0) * 1000
    steps["ready (start() returns)"] = float("nan")
    steps["_agent"] = agent
    steps["_child"] = child
    return steps


def on_cpu(
    window: list[tuple[float, str, int, int, str, str]], host: int, agent: int
) -> dict[str, float]:
    """ms each kind of process ran inside the window: a ``sched_switch`` sample belongs to
    the task switched out (its process id is the sample's), which ran since the previous
    switch on that core."""
    last: dict[int, float] = {}
    used: dict[str, float] = defaultdict(float)
    for when, comm, pid, cpu, name, _ in window:
        if name != "sched:sched_switch":
            continue
        if cpu in last and pid != 0:
            kind = (
                "host process (all threads)"
                if pid == host
                else "guest agent"
                if pid == agent
                else comm
                if comm in ("bwrap", "unshare", "setpriv")
                else "the rest of the machine"
            )
            used[kind] += (when - last[cpu]) * 1000
        last[cpu] = when
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        asyncio.run(starts(args.runs, args.child))
        return
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (apt-get install linux-perf)")
    with tempfile.TemporaryDirectory() as tmp:
        data, marks = Path(tmp, "perf.data"), Path(tmp, "marks.json")
        me = [sys.executable, __file__, "--runs", str(args.runs), "--child", str(marks)]
        record = ["perf", "record", "-q", "-a", "-k", "mono", "-o", str(data)]
        for event in EVENTS:
            record += ["-e", event]
        subprocess.run([*record, "--", *me], check=True)
        text = subprocess.run(
            ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,cpu,time,event,trace"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found = json.loads(marks.read_text())
    events = parse(text)
    rows: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    total = []
    for start in found:
        t0, t1 = start["t0"], start["t1"]
        window = [e for e in events if t0 <= e[0] <= t1]
        steps = box_steps(window, t0)
        agent = int(steps.pop("_agent"))
        steps.pop("_child")
        steps["ready (start() returns)"] = (t1 - t0) * 1000
        total.append((t1 - t0) * 1000)
        for name, ms in steps.items():
            rows[(name, "box")].append((ms, ms))
        for name, begin, end, thread in start["host"]:
            rows[(name, re.sub(r"_\d+$", "", thread))].append((begin * 1000, end * 1000))
        for kind, ms in on_cpu(window, start["pid"], agent).items():
            cpu[kind].append(ms)
    print(
        f"create-to-ready p50 {statistics.median(total):.2f} ms over {len(total)} starts "
        f"(load average {os.getloadavg()[0]:.2f})"
    )
    print("timeline, median ms from the start() call")
    order = sorted(rows.items(), key=lambda kv: statistics.median(b for b, _ in kv[1]))
    for (name, thread), spans in order:
        begin = statistics.median(b for b, _ in spans)
        end = statistics.median(e for _, e in spans)
        span = f"{begin:7.2f}" if thread == "box" else f"{begin:7.2f} -> {end:7.2f}"
        print(f"  {name:<36} {span:<18} [{thread}]")
    print("on a core inside the window, median ms per start")
    for kind, values in sorted(cpu.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {kind:<36} {statistics.median(values):7.2f}")


if __name__ == "__main__":
    main()
