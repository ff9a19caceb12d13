"""Prompt-to-expect latency: a program in the box prints a prompt, how soon does expect return?

Measured against a raw PTY read loop in the same run (os.openpty, the same program as a local
process, a blocking read + regex loop, no sandbox, no asyncio). The program stamps each prompt
with CLOCK_MONOTONIC (one clock for the whole machine: bwrap makes no time namespace), and
the reader takes the difference when its match returns. Target: p50 within 2 ms of raw.

Run: ``python bench/bench_expect.py [--runs 200]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time

from corral import Sandbox

# Waits for a line, then prints a prompt carrying the time it was written.
PROGRAM = (
    "import os, sys, time\n"
    "while sys.stdin.readline():\n"
    "    os.write(1, b'Enter a value %d: ' % time.clock_gettime_ns(time.CLOCK_MONOTONIC))\n"
)
PATTERN = r"Enter a value (\d+): "
WARMUP = 20


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def raw_pty_latencies(runs: int) -> list[float]:
    """The baseline: a local process on a PTY and the simplest possible read loop."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", PROGRAM], stdin=slave, stdout=slave, close_fds=True
    )
    os.close(slave)
    regex = re.compile(PATTERN.encode())
    samples: list[float] = []
    try:
        for _ in range(runs + WARMUP):
            os.write(master, b"\n")
            pending = b""
            while (found := regex.search(pending)) is None:
                pending += os.read(master, 65536)
            samples.append((now_ns() - int(found.group(1))) / 1e6)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    return samples[WARMUP:]


async def corral_latencies(runs: int) -> list[float]:
    """The same program in a sandbox, on a session terminal, waited for with expect."""
    async with Sandbox() as sb:
        sh = await sb.shell()
        await sh.write(f"exec python3 -I -S -c {_quote(PROGRAM)}\n")
        samples: list[float] = []
        for _ in range(runs + WARMUP):
            await sh.write("\n")
            m = await sh.expect(PATTERN, timeout=10)
            if not m.matched:
                raise RuntimeError(f"no prompt ({m.reason}); output: {m.output!r}")
            samples.append((now_ns() - int(m.captures[1])) / 1e6)
        await sh.close()
    return samples[WARMUP:]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args(argv)
    raw = raw_pty_latencies(args.runs)
    boxed = asyncio.run(corral_latencies(args.runs))
    print(f"prompt -> expect latency over {args.runs} runs (ms)")
    print(f"{'':18}{'p50':>8}{'p99':>8}{'mean':>8}")
    for name, s in (("raw pty loop", raw), ("corral expect", boxed)):
        p50, p99 = percentile(s, 0.5), percentile(s, 0.99)
        print(f"{name:18}{p50:8.3f}{p99:8.3f}{statistics.fmean(s):8.3f}")
    d50 = percentile(boxed, 0.5) - percentile(raw, 0.5)
    d99 = percentile(boxed, 0.99) - percentile(raw, 0.99)
    ratio = percentile(boxed, 0.5) / max(percentile(raw, 0.5), 1e-9)
    verdict = "within" if d50 <= 2.0 else "NOT within"
    print(f"p50 +{d50:.3f} ms ({ratio:.1f}x raw), p99 +{d99:.3f} ms: {verdict} the 2 ms target")
    return 0 if d50 <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
