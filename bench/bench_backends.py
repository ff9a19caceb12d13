"""Create-to-ready latency of each backend, measured in one run, next to raw bwrap.

    python bench/bench_backends.py [--runs N]

create-to-ready: from ``Sandbox.start()`` until the guest agent has said it is ready (the
box exists, limits and seccomp apply, commands can run). Backends take turns round by
round, so a noisy neighbour on this shared machine slows all of them alike. Each box is
closed before the next starts; the close is timed too. warm run: ``run(["true"])`` in a box
that is already up (spawn, exit, output collected), and ``ls -l /usr/bin`` there (stat-heavy:
under runsc every stat is served by gVisor's kernel and its file server).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time

from run import RAW_BWRAP, line, timed_sync

from corral import Policy, Sandbox
from corral.backends import unavailable_reason

BACKENDS: dict[str, Policy] = {
    "bwrap": Policy(),
    "oci runc": Policy.from_dict({"backend": "oci", "runtime": "runc"}),
    "oci crun": Policy.from_dict({"backend": "oci", "runtime": "crun"}),
    "oci runsc": Policy.from_dict({"backend": "oci", "runtime": "runsc"}),
}


async def measure(policy: Policy) -> tuple[float, float]:
    """Seconds to ready, and seconds to close."""
    box = Sandbox(policy)
    t = time.perf_counter()
    await box.start()
    ready = time.perf_counter() - t
    t = time.perf_counter()
    await box.aclose()
    return ready, time.perf_counter() - t


async def warm(policy: Policy, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per ``true`` and per ``ls -l /usr/bin`` in one box that is already up."""
    true: list[float] = []
    listing: list[float] = []
    async with Sandbox(policy) as box:
        await box.run(["true"])
        for _ in range(runs):
            t = time.perf_counter()
            await box.run(["true"])
            true.append(time.perf_counter() - t)
            t = time.perf_counter()
            await box.run(["ls", "-l", "/usr/bin"], check=True)
            listing.append(time.perf_counter() - t)
    return true, listing


async def main(runs: int) -> None:
    print(f"corral backend start-up ({runs} runs each, {os.cpu_count()} cpus)")
    usable = {}
    for name, policy in BACKENDS.items():
        reason = unavailable_reason(policy)
        if reason:
            print(f"  {name}: skipped ({reason})")
        else:
            usable[name] = policy
    raw = line("raw bwrap ... true", timed_sync(lambda: subprocess.run(RAW_BWRAP), runs))
    for policy in usable.values():
        await measure(policy)  # warm the page cache and the runtimes' first-run work
    ready: dict[str, list[float]] = {name: [] for name in usable}
    close: dict[str, list[float]] = {name: [] for name in usable}
    for _ in range(runs):
        for name, policy in usable.items():
            r, c = await measure(policy)
            ready[name].append(r)
            close[name].append(c)
    print("create-to-ready")
    p50 = {name: line(name, samples) for name, samples in ready.items()}
    print("close")
    for name, samples in close.items():
        line(name, samples)
    print("warm run: true")
    listings = {}
    for name, policy in usable.items():
        true, listings[name] = await warm(policy, runs)
        line(name, true)
    print("warm run: ls -l /usr/bin")
    for name, samples in listings.items():
        line(name, samples)
    print("ratios (p50 create-to-ready)")
    base = p50.get("bwrap")
    for name, value in p50.items():
        vs_bwrap = f"{value / base:6.2f}x bwrap backend" if base else ""
        print(f"  {name:<10} {value / raw:6.2f}x raw bwrap   {vs_bwrap}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    asyncio.run(main(parser.parse_args().runs))
