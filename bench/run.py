"""Foundation benchmarks: every figure next to a baseline measured in the same run.

    python bench/run.py [--runs N] [--only NAME ...]

Prints p50/p90 in milliseconds and the ratios the foundation issue targets:
  warm run       (a command in an existing box)   vs  subprocess.run(["true"])   target <= 3x
  one-shot       (warm pool: claim, run, release) vs  raw `bwrap ... true`       target <= 3x
  one-shot       (new box, run, close; library)   vs  raw `bwrap ... true`       (reported)
  one-shot CLI   (`corral run -- true` process)   vs  raw `bwrap ... true`       (reported)
  create-to-ready (cold box)                       vs  raw `bwrap ... true`       target <= 25 ms
  host memory per idle box (RSS of its bwrap + agent processes, and the host-side heap)
and, each in a process of its own with its own baseline (issue 14's data path figures):
  files          50 MiB through sb.files.write/read   vs  the host's write/read      target <= 2x
  stream         200 MB of `corral run` stdout         vs  a bare pipe
  capture        512 MiB of output, 64 MiB cap: host heap and peak RSS growth vs the cap
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

from corral import Sandbox, SandboxPool

RAW_BWRAP = [
    "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
    "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--", "true",
]  # fmt: skip


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def line(name: str, samples: list[float]) -> float:
    p50 = statistics.median(samples) * 1000
    print(f"  {name:<34} p50 {p50:8.2f} ms   p90 {pct(samples, 0.9):8.2f} ms   n={len(samples)}")
    return p50


def timed_sync(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


async def timed_async(fn: Callable[[], Awaitable[object]], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def pss_kib(pid: int) -> int:
    """Proportional set size: shared pages (libpython, libc) divided among their users."""
    for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if ln.startswith("Pss:"):
            return int(ln.split()[1])
    return 0


def box_pids(sandbox_id: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if sandbox_id.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


async def idle_memory(count: int) -> tuple[float, float]:
    """Mean PSS (MiB) of a box's processes, and host-side Python heap per box (MiB)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    boxes = [Sandbox() for _ in range(count)]
    await asyncio.gather(*(b.start() for b in boxes))
    await asyncio.gather(*(b.run(["true"]) for b in boxes))
    heap = (tracemalloc.get_traced_memory()[0] - base) / count / 2**20
    tracemalloc.stop()
    rss = [sum(pss_kib(p) for p in box_pids(b.sandbox_id)) / 1024 for b in boxes]
    await asyncio.gather(*(b.aclose() for b in boxes))
    return statistics.mean(rss), heap


async def pooled_one_shot(runs: int) -> float:
    """``SandboxPool.run``: a started box gets the workspace bound in, runs, is stopped.
    The pool is let to refill (and tear released boxes down) between calls, as between an
    agent's steps; the time measured is the caller's, from call to result."""
    ws = tempfile.mkdtemp(prefix="corral-bench-")
    samples = []
    try:
        async with SandboxPool(size=2) as pool:
            for _ in range(runs):
                await pool.wait_idle()
                t = time.perf_counter()
                await pool.run(["true"], workspace=ws)
                samples.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    return line("one-shot (library, warm pool)", samples)


DATA_PATH = {
    "files": "bench_files.py",
    "stream": "bench_cli_stream.py",
    "capture": "bench_capture.py",
}
ROWS = ("warm", "ready", "oneshot", "pooled", "cli", "memory", *DATA_PATH)


async def main(runs: int, only: set[str]) -> None:
    print(f"corral foundation benchmarks ({runs} runs each, {os.cpu_count()} cpus)")
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("baselines")
    bare = line("subprocess.run(['true'])", timed_sync(lambda: subprocess.run(["true"]), runs))
    raw = line("raw bwrap ... true", timed_sync(lambda: subprocess.run(RAW_BWRAP), runs))

    print("corral")
    ratios = []
    if "warm" in only:
        async with Sandbox() as sb:
            await sb.run(["true"])  # first spawn imports subprocess in the agent
            warm = line(
                "warm run (existing box)", await timed_async(lambda: sb.run(["true"]), runs)
            )
        ratios.append(f"  warm run / bare subprocess        {warm / bare:6.2f}x   (target <= 3x)")

    if "ready" in only:
        create_samples: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            box = Sandbox()
            await box.start()
            create_samples.append(time.perf_counter() - t0)
            await box.aclose()
        ready = line("create-to-ready", create_samples)
        ratios.append(
            f"  create-to-ready / raw bwrap       {ready / raw:6.2f}x   "
            f"({ready:.1f} ms vs {raw:.1f} ms; target <= 25 ms)"
        )

    if "oneshot" in only:

        async def one_shot() -> None:
            async with Sandbox() as box:
                await box.run(["true"])

        oneshot = line("one-shot (library, cold box)", await timed_async(one_shot, runs))
        ratios.append(f"  one-shot (cold box) / raw bwrap   {oneshot / raw:6.2f}x")
    if "pooled" in only:
        pooled = await pooled_one_shot(runs)
        ratios.append(f"  one-shot (warm pool) / raw bwrap  {pooled / raw:6.2f}x   (target <= 3x)")
    if "cli" in only:
        with tempfile.TemporaryDirectory() as project:  # /tmp itself is refused as a workspace
            cli = [sys.executable, "-m", "corral.cli", "run", "--workspace", project, "--", "true"]
            cli_ms = line(
                "one-shot `corral run` (CLI)",
                timed_sync(lambda: subprocess.run(cli, check=True), max(1, runs // 2)),
            )
        ratios.append(f"  one-shot (CLI) / raw bwrap        {cli_ms / raw:6.2f}x")
    if "memory" in only:
        rss, heap = await idle_memory(10)
        print(f"  {'idle box: its processes PSS':<34} {rss:8.2f} MiB")
        print(f"  {'idle box: host-side heap':<34} {heap:8.3f} MiB")
        ratios.append(
            f"  idle box host memory              {rss + heap:6.2f} MiB (target <= 15 MB)"
        )

    print("ratios (p50)")
    print("\n".join(ratios))


def data_path(only: set[str]) -> None:
    """The data path figures, a process each: its peak RSS and heap are its own."""
    for row, script in DATA_PATH.items():
        if row in only:
            print(f"{row} (bench/{script})", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).with_name(script))], check=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument(
        "--only",
        action="append",
        choices=ROWS,
        help="measure only this row (repeatable); the baselines are always measured",
    )
    args = parser.parse_args()
    asyncio.run(main(args.runs, set(args.only or ROWS)))
    data_path(set(args.only or ROWS))
