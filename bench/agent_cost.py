"""What the guest agent costs, in figures a busy machine does not move much.

    python bench/agent_cost.py [--runs N] [--no-callgrind]

On a shared 2-core host the wall clock of a box start or a warm run swings by 2x with the
other load; these are what to compare between two versions instead:

- instructions (callgrind, deterministic to ~0.1%) of ``python3 -I -S agent.py`` outside a box,
  on a socketpair, from exec to its "ready" frame, and from exec to the end of what it loads
  after "ready" (what the first request waits for); beside them the bare interpreter's
  start (``-c "import posix; posix._exit(0)"``: the floor of any Python agent). The agent
  is run by the interpreter the backend picks, as the box runs it.
- CPU per warm ``run(["true"])`` in a started box: the host process's (``process_time``) and
  the agent's (``/proc/PID/schedstat``), mean of ``--runs`` runs.

``bench/profile_start.py`` has the CPU of each box process at create-to-ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_start import children, schedstat_ms

from corral import Sandbox
from corral.backends.base import AGENT_DIR
from corral.backends.host.python import compile_agent, find_python

_COLLECTED = re.compile(rb"Collected : (\d+)")


def callgrind(argv: list[str]) -> int:
    """Instructions of ``argv`` (a script ``agent.py`` is given its config as the last
    argument and a socketpair channel, closed once "ready" arrives: the agent then ends after
    what it loads past "ready")."""
    host, guest = socket.socketpair()
    config = {
        "fd": guest.fileno(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "home": "",
        "rlimits": {"nofile": 1024},
        "landlock": {"off": "not measured"},
    }
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}/cg",
            *argv,
            json.dumps(config),
        ]
        proc = subprocess.Popen(cmd, pass_fds=[guest.fileno()], stderr=subprocess.PIPE)
        guest.close()
        if argv[-1].endswith("agent.py"):
            host.settimeout(120)
            host.recv(4096)  # "ready"
        host.close()
        _, err = proc.communicate(timeout=300)
    found = _COLLECTED.findall(err)
    return int(found[-1]) if found else -1


def ready_instructions(python: str) -> None:
    """Exec -> "ready" needs the agent to stop right after it: run a copy of agent.py that
    exits where the loop would start (the same imports and the same Agent construction)."""
    agent = AGENT_DIR / "agent.py"
    bare = callgrind([python, "-I", "-S", "-c", "import posix; posix._exit(0)"])
    full = callgrind([python, "-I", "-S", str(agent)])
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "agent.py"
        source = agent.read_text().replace(
            "    loop.serve(config)",
            "    loop.Agent.finish_start = lambda self: posix._exit(0)\n    loop.serve(config)",
        )
        probe.write_text(
            f"import posix\nimport sys\nsys.path.insert(0, {str(AGENT_DIR)!r})\n" + source
        )
        ready = callgrind([python, "-I", "-S", str(probe)])
    print(f"  {'bare interpreter: exec -> its first line':<40} {bare / 1e6:8.2f} M instructions")
    print(f"  {'agent: exec -> ready':<40} {ready / 1e6:8.2f} M instructions")
    print(f"  {'agent: exec -> first request served':<40} {full / 1e6:8.2f} M instructions")


async def warm_cpu(runs: int) -> None:
    async with Sandbox() as sb:
        for _ in range(5):
            await sb.run(["true"])
        monitor = getattr(getattr(sb, "_box", None), "_proc", None)
        inits = children(monitor.pid) if monitor is not None else []
        agents = children(inits[0]) if inits else []
        if not agents:
            print("  (the agent's process was not found: bwrap backend only)")
            return
        agent = agents[0]
        a0, h0, t0 = schedstat_ms(agent), time.process_time(), time.perf_counter()
        for _ in range(runs):
            await sb.run(["true"])
        a1, h1, t1 = schedstat_ms(agent), time.process_time(), time.perf_counter()
    print(f"  {'warm run: host process CPU':<40} {(h1 - h0) / runs * 1000:8.3f} ms")
    print(f"  {'warm run: agent CPU':<40} {(a1 - a0) / runs:8.3f} ms")
    print(f"  {'warm run: wall (mean)':<40} {(t1 - t0) / runs * 1000:8.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--no-callgrind", action="store_true")
    args = parser.parse_args()
    print(f"guest agent cost (load average {os.getloadavg()[0]:.2f})")
    python = find_python()
    compile_agent(AGENT_DIR, python)  # as a box start does: the agent's .pyc exist
    if not args.no_callgrind:
        if shutil.which("valgrind") is None:
            print("  (valgrind not installed: no instruction counts)")
        else:
            ready_instructions(python)
    asyncio.run(warm_cpu(args.runs))


if __name__ == "__main__":
    main()
