"""``corral serve`` next to the library and raw bwrap, all measured in one run.

    python bench/bench_serve.py [--runs N] [--seconds S] [--clients C]

Starts its own server on a unix socket in a temporary runtime directory, then prints:

- **``corral run -- true``** through the server (the console script, a new process per run)
  next to raw ``bwrap ... true``, ``python -c pass`` and ``corral run`` without a server.
  Issue 16's target: within 8x of raw bwrap.
- **create-to-first-command through the API**: ``POST /v1/boxes`` then ``run true`` (cold),
  and a one-shot ``run true`` from the server's warm pool (``/v1/cli/run``, pooled), next to
  the library's ``Sandbox`` start + run and ``SandboxPool.run`` in this process.
- **requests per second** of ``run true`` with ``--clients`` concurrent clients, each on a
  box of its own, next to the same number of in-process sandboxes running ``true``.

Medians over ``--runs``; a first, unmeasured round warms caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from corral import Sandbox, SandboxPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from run import RAW_BWRAP

from served import serving

TARGET_VS_BWRAP = 8.0


def wall(argv: list[str], runs: int, cwd: str, env: dict[str, str]) -> float:
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}")
    return statistics.median(times[1:])


async def timed(call: Callable[[], Awaitable[object]], runs: int) -> float:
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def rps(workers: list[Callable[[], Awaitable[object]]], seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def loop(call: Callable[[], Awaitable[object]]) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(w) for w in workers))
    return done / (time.perf_counter() - start)


async def api_figures(
    url: str, ws: str, runs: int, seconds: float, clients: int
) -> dict[str, float]:
    sock = url.removeprefix("unix:")
    transport = httpx.AsyncHTTPTransport(uds=sock)
    out: dict[str, float] = {}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://localhost", timeout=120
    ) as client:

        async def cold() -> None:
            box = (await client.post("/v1/boxes", json={"workspace": ws})).json()["id"]
            r = await client.post(f"/v1/boxes/{box}/run", json={"cmd": ["true"]})
            assert r.json()["exit_code"] == 0
            await client.delete(f"/v1/boxes/{box}")

        spec = json.dumps({"argv": ["--workspace", ws, "--no-presets", "--", "true"]})

        async def pooled() -> None:
            r = await client.post("/v1/cli/run", headers={"X-Corral-Run": spec})
            assert r.status_code == 200

        out["api cold: create + run true"] = await timed(cold, runs)
        out["api pooled: one-shot run true"] = await timed(pooled, runs)
        boxes = [(await client.post("/v1/boxes", json={})).json()["id"] for _ in range(clients)]

        def worker(box: str) -> Callable[[], Awaitable[object]]:
            async def call() -> None:
                await client.post(f"/v1/boxes/{box}/run", json={"cmd": ["true"]})

            return call

        out["api rps"] = await rps([worker(b) for b in boxes], seconds)
        for box in boxes:
            await client.delete(f"/v1/boxes/{box}")
    return out


async def library_figures(ws: str, runs: int, seconds: float, clients: int) -> dict[str, float]:
    out: dict[str, float] = {}

    async def cold() -> None:
        async with Sandbox(workspace=ws) as sb:
            await sb.run(["true"])

    out["library cold: start + run true"] = await timed(cold, runs)
    async with SandboxPool(size=2) as pool:

        async def pooled() -> None:
            await pool.run(["true"], workspace=ws)

        out["library pooled: one-shot run true"] = await timed(pooled, runs)
    boxes = [Sandbox() for _ in range(clients)]
    await asyncio.gather(*(b.start() for b in boxes))

    def worker(box: Sandbox) -> Callable[[], Awaitable[object]]:
        async def call() -> None:
            await box.run(["true"])

        return call

    try:
        out["library rps"] = await rps([worker(b) for b in boxes], seconds)
    finally:
        await asyncio.gather(*(b.aclose() for b in boxes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    corral = [str(Path(sys.executable).with_name("corral"))]
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as tmp:
        ws = os.path.join(tmp, "ws")
        os.mkdir(ws)
        os.chmod(tmp, 0o755)
        with serving(
            Path(tmp) / "run",
            "--socket",
            os.path.join(tmp, "s.sock"),
            "--max-boxes",
            str(args.clients + 8),
        ) as served:
            env = {k: v for k, v in served.env.items() if k != "PYTHONDONTWRITEBYTECODE"}
            local_env = {**env, "CORRAL_HOST": "local"}
            run = [*corral, "run", "--no-presets", "--", "true"]
            cli = {
                "python -c pass": wall([sys.executable, "-c", "pass"], args.runs, ws, env),
                "raw bwrap ... true": wall(RAW_BWRAP, args.runs, ws, env),
                "corral run -- true (server)": wall(run, args.runs, ws, env),
                "corral run -- true (no server)": wall(run, max(3, args.runs // 3), ws, local_env),
            }
            api = asyncio.run(api_figures(served.url, ws, args.runs, args.seconds, args.clients))
        lib = asyncio.run(library_figures(ws, args.runs, args.seconds, args.clients))
    bwrap = cli["raw bwrap ... true"]
    print(f"corral serve, one run (medians of {args.runs}; ms)")
    for name, value in cli.items():
        print(f"  {name:40} {value * 1e3:8.1f}  {value / bwrap:6.1f}x raw bwrap")
    through = cli["corral run -- true (server)"] / bwrap
    verdict = "met" if through <= TARGET_VS_BWRAP else "missed"
    print(
        f"  target: corral run through the server <= {TARGET_VS_BWRAP:g}x raw bwrap: "
        f"{through:.1f}x ({verdict})"
    )
    pairs = [
        ("api cold: create + run true", "library cold: start + run true"),
        ("api pooled: one-shot run true", "library pooled: one-shot run true"),
    ]
    for ours, theirs in pairs:
        print(
            f"  {ours:40} {api[ours] * 1e3:8.1f}  vs {theirs}: {lib[theirs] * 1e3:.1f} "
            f"({api[ours] / lib[theirs]:.2f}x)"
        )
    print(
        f"  run true, {args.clients} clients: API {api['api rps']:.0f}/s, library "
        f"{lib['library rps']:.0f}/s ({api['api rps'] / lib['library rps']:.2f}x)"
    )


if __name__ == "__main__":
    main()
