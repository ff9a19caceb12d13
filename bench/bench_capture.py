"""Host memory of a capped capture, next to the cap, measured in one run.

    python bench/bench_capture.py [--cap-mb 64] [--out-mb 512]

A command writes ``--out-mb`` MiB to stdout in a box whose ``limits.output_bytes`` is
``--cap-mb`` MiB; ``sb.run`` keeps the first cap's worth and flags the result truncated.
Prints the peak of the host's Python heap during the run (tracemalloc: what the capture
allocated, the kept bytes included) and the growth of the process's peak RSS, each as a
multiple of the cap (target: about 1x; the issue found 3.5x). The output must be drained
to the end, so the run also shows the capture's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
import tracemalloc

from corral import Policy, Sandbox


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cap-mb", type=int, default=64)
    ap.add_argument("--out-mb", type=int, default=512)
    args = ap.parse_args()
    cap = args.cap_mb << 20
    policy = Policy.from_dict({"limits": {"output_bytes": cap}})
    async with Sandbox(policy) as sb:
        await sb.run(["true"])
        rss_before = peak_rss_mib()
        tracemalloc.start()
        t0 = time.perf_counter()
        r = await sb.run(["sh", "-c", f"head -c {args.out_mb << 20} /dev/zero"], timeout=600)
        took = time.perf_counter() - t0
        _, heap_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_growth = peak_rss_mib() - rss_before
    kept = len(r.stdout)
    assert r.truncated and kept <= cap + 4096, (r.truncated, kept)  # and its truncation note
    print(f"{args.out_mb} MiB of output, cap {args.cap_mb} MiB: kept {kept >> 20} MiB, "
          f"truncated={r.truncated}, {args.out_mb / took:.0f} MiB/s")  # fmt: skip
    print(f"  host heap peak   {heap_peak / 2**20:8.1f} MiB   {heap_peak / cap:5.2f}x the cap")
    print(f"  peak RSS growth  {rss_growth:8.1f} MiB   {rss_growth * 2**20 / cap:5.2f}x the cap")


if __name__ == "__main__":
    asyncio.run(main())
