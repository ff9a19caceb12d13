"""The files API moving a large file, next to the host doing the same in the same run.

    python bench/bench_files.py [--mb 50] [--runs 5]

Prints p50 seconds and MB/s of ``sb.files.write`` and ``sb.files.read`` of one file, and of
the host writing and reading the same bytes in the same directory (write + fsync-free close,
read of a file just written: both from the page cache), and the ratios (target: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from corral import Sandbox


async def timed(fn: Callable[[], Awaitable[object]], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def host_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def host_read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    data = os.urandom(args.mb << 20)
    with tempfile.TemporaryDirectory(prefix="corral-bench-files-") as tmp:
        ws = Path(tmp)
        host_file = ws / "host.bin"

        async def hw() -> None:
            host_write(host_file, data)

        async def hr() -> None:
            assert len(host_read(host_file)) == len(data)

        async with Sandbox(workspace=ws) as sb:

            async def bw() -> None:
                await sb.files.write("box.bin", data)

            async def br() -> None:
                got = await sb.files.read("box.bin", max_bytes=len(data))
                assert len(got) == len(data)

            await bw()  # warm: the file exists, the page cache holds it
            hw_s, hr_s = await timed(hw, args.runs), await timed(hr, args.runs)
            bw_s, br_s = await timed(bw, args.runs), await timed(br, args.runs)
            assert await sb.files.read("box.bin", max_bytes=len(data)) == data

    mb = args.mb
    print(f"{mb} MiB, p50 of {args.runs} runs")
    print(f"  write  files API {bw_s:7.3f} s {mb / bw_s:8.0f} MB/s   host {hw_s:7.3f} s "
          f"{mb / hw_s:8.0f} MB/s   ratio {bw_s / hw_s:5.1f}x (target <= 2x)")  # fmt: skip
    print(f"  read   files API {br_s:7.3f} s {mb / br_s:8.0f} MB/s   host {hr_s:7.3f} s "
          f"{mb / hr_s:8.0f} MB/s   ratio {br_s / hr_s:5.1f}x (target <= 2x)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
