"""What Landlock costs: boxes with ``security.landlock`` on and off, taking turns in one run.

    python bench/bench_landlock.py [--rounds N]

create-to-ready: ``Sandbox.start()`` until the agent is ready (the agent applies its rules
right after "ready", so this should not move). first run: start plus the first
``run(["true"])`` (which waits for the rules). warm run: ``run(["true"])`` in a box that is up.
in-box: one command timing 20000 open+close of a file of the system view and 200 fork+exec
of /bin/true, the per-operation cost Landlock's checks add inside a box.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import line

from corral import Policy, Sandbox

PROBE = r"""
import os, time
t = time.perf_counter()
for _ in range(20000):
    os.close(os.open("/etc/os-release", os.O_RDONLY))
o = (time.perf_counter() - t) / 20000
t = time.perf_counter()
for _ in range(200):
    pid = os.fork()
    if pid == 0:
        os.execv("/bin/true", ["true"])
    os.waitpid(pid, 0)
print(o, (time.perf_counter() - t) / 200)
"""


async def one(
    landlock: bool, workspace: str, warm: int
) -> tuple[float, float, float, float, float]:
    sb = Sandbox(Policy(security={"landlock": landlock}), workspace=workspace)
    t = time.perf_counter()
    await sb.start()
    ready = time.perf_counter() - t
    await sb.run(["true"])
    first = time.perf_counter() - t
    runs = []
    for _ in range(warm):
        t = time.perf_counter()
        await sb.run(["true"])
        runs.append(time.perf_counter() - t)
    probe = await sb.run(["python3", "-c", PROBE])
    opened, forked = map(float, probe.stdout.split())
    info = await sb.info()
    await sb.aclose()
    assert info["landlock"]["enforced"] is landlock or not landlock, info["landlock"]
    return ready, first, statistics.median(runs), opened, forked


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warm", type=int, default=20)
    args = parser.parse_args()
    samples: dict[bool, list[tuple[float, ...]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as ws:
        for _ in range(args.rounds):
            for landlock in (True, False):
                samples[landlock].append(await one(landlock, ws, args.warm))
    names = ("create-to-ready", "first run (start + true)", "warm run true")
    for landlock in (True, False):
        print(f"landlock {'on' if landlock else 'off'}:")
        columns = list(zip(*samples[landlock], strict=True))
        for name, column in zip(names, columns, strict=False):
            line(name, list(column))
        opened, forked = (statistics.median(c) * 1e6 for c in columns[3:])
        print(f"  {'in-box open+close':<34} p50 {opened:8.2f} us")
        print(f"  {'in-box fork+exec /bin/true':<34} p50 {forked:8.0f} us")


if __name__ == "__main__":
    asyncio.run(main())
