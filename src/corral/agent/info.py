"""What the box reports about itself: the kernel and memory, a process group's use of CPU and
memory, and (in a microVM, where the host sees no cgroup of the box) the box's cgroup counters.
Imported on first use: most boxes never ask."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any

    from corral.agent import protocol


def collect_info(extra: dict[str, Any]) -> protocol.InfoReply:
    u = os.uname()
    mem_total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    reply: protocol.InfoReply = {
        "kernel": f"{u.sysname} {u.release}",
        "hostname": u.nodename,
        "arch": u.machine,
        "cpus": len(os.sched_getaffinity(0)),
        "memory_bytes": mem_total,
        "agent_pid": os.getpid(),
        "python": sys.version.split()[0],
    }
    if "sandbox_id" in extra:  # what the backend named in the agent's config
        reply["sandbox_id"] = str(extra["sandbox_id"])
    if "workdir" in extra:
        reply["workdir"] = str(extra["workdir"])
    return reply


def process_group_stats(pgid: int, exited: bool) -> protocol.StatsReply:
    """CPU time and memory of every live process in the group ``pgid`` (the command's tree)."""
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    cpu = 0.0
    rss = 0
    count = 0
    state = "exited" if exited else "unknown"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if int(fields[2]) != pgid and int(name) != pgid:
            continue
        count += 1
        cpu += (int(fields[11]) + int(fields[12])) / tick
        rss += int(fields[21]) * page
        if int(name) == pgid:
            state = {
                "R": "running",
                "S": "sleeping",
                "D": "disk-sleep",
                "T": "stopped",
                "t": "stopped",
                "Z": "zombie",
            }.get(fields[0], fields[0])
    return {"cpu_seconds": cpu, "rss_bytes": rss, "state": state, "processes": count}


def cgroup_counters(path: str) -> dict[str, int]:
    """A cgroup v2 group's accounting, as the host's :class:`BoxStats` names it."""

    def keyed(name: str) -> dict[str, str]:
        try:
            with open(f"{path}/{name}") as f:
                return dict(line.split(None, 1) for line in f if " " in line)
        except OSError:
            return {}

    def number(name: str) -> int | None:
        try:
            with open(f"{path}/{name}") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    out = {
        "oom_kills": int(keyed("memory.events").get("oom_kill", "0")),
        "pids_limit_hits": int(keyed("pids.events").get("max", "0")),
    }
    for key, name in (
        ("pids", "pids.current"),
        ("memory_bytes", "memory.current"),
        ("memory_peak_bytes", "memory.peak"),
    ):
        value = number(name)
        if value is not None:
            out[key] = value
    usage = keyed("cpu.stat").get("usage_usec")
    if usage is not None:
        out["cpu_usec"] = int(usage)
    return out
