"""``corral run`` streaming throughput vs a bare pipe, measured in the same run.

    python bench/bench_cli_stream.py [--mb 200] [--runs 3]

Both sides run ``sh -c 'cat /dev/zero | head -c N'`` and pipe its stdout into a reader that
counts the bytes: once directly on the host (the bare pipe), once as ``corral run -- ...``
(a box started, the bytes relayed through the guest agent and the host, the box torn down).
Prints MB/s of each (best of --runs) and the ratio; the CLI's figure includes its box start,
so it is also shown with the time of ``corral run -- true`` taken off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CORRAL = [sys.executable, "-m", "corral.cli"]
CHUNK = 1 << 20


def timed(argv: list[str], expected: int, cwd: str) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=cwd)
    assert proc.stdout is not None
    got = 0
    while data := os.read(proc.stdout.fileno(), CHUNK):
        got += len(data)
    status = proc.wait()
    elapsed = time.perf_counter() - start
    if status != 0 or got != expected:
        raise SystemExit(f"{argv[:4]}...: status {status}, {got} of {expected} bytes")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    size = args.mb * 1_000_000
    script = ["sh", "-c", f"cat /dev/zero | head -c {size}"]
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as ws:
        os.chmod(ws, 0o755)
        bare = min(timed(script, size, ws) for _ in range(args.runs))
        cli = min(timed([*CORRAL, "run", "--", *script], size, ws) for _ in range(args.runs))
        start = min(timed([*CORRAL, "run", "--", "true"], 0, ws) for _ in range(args.runs))
    mbs = size / 1e6
    print(f"stream {args.mb} MB through stdout (best of {args.runs})")
    print(f"  bare pipe            {bare * 1000:8.0f} ms  {mbs / bare:8.0f} MB/s")
    print(f"  corral run           {cli * 1000:8.0f} ms  {mbs / cli:8.0f} MB/s")
    print(f"  corral run -- true   {start * 1000:8.0f} ms  (box start, relay set-up, teardown)")
    relay = max(cli - start, 1e-9)
    print(f"  corral run, start taken off      {mbs / relay:8.0f} MB/s")
    print(f"  ratio bare/corral: {cli / bare:.1f}x (whole command), {relay / bare:.1f}x (stream)")


if __name__ == "__main__":
    main()
