"""Rootless boxes next to root mode and raw unprivileged bwrap, in one run.

    python bench/bench_rootless.py [--runs N]      # as root; `make setup` made the test users

create-to-ready: from ``Sandbox.start()`` until the guest agent is ready (as in
bench_backends.py). warm run: ``run(["true"])`` in a box that is up. Root mode runs in this
process; each rootless variant in a worker process of its own, run as an unprivileged test
user (``corral-rootless``: subordinate ids, newuidmap/newgidmap; ``corral-nosubid``: one id),
driven round by round over a pipe, so every variant takes its turn in each round and a busy
neighbour slows them alike. "raw bwrap (user)" is ``bwrap --unshare-all ... true`` run by that
user: the floor of any unprivileged sandbox here. The checkout must be readable by the test
users (it is bound read-only for them by tests/test_rootless.py; here it is used in place).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import RAW_BWRAP, line

from corral import Policy, Sandbox

REPO = Path(__file__).resolve().parents[1]
USERS = {"rootless (subordinate ids)": "corral-rootless", "rootless (one id)": "corral-nosubid"}
TARGET = 1.2


async def ready_once(workspace: str | None) -> float:
    box = Sandbox(Policy(), workspace=workspace)
    t = time.perf_counter()
    await box.start()
    ready = time.perf_counter() - t
    await box.aclose()
    return ready


def raw_once() -> float:
    """Seconds for raw unprivileged ``bwrap --unshare-all ... true``."""
    t = time.perf_counter()
    subprocess.run(RAW_BWRAP, check=True)
    return time.perf_counter() - t


async def time_true(box: Sandbox) -> float:
    t = time.perf_counter()
    await box.run(["true"])
    return time.perf_counter() - t


async def worker() -> None:
    """Serve the coordinator's requests, one JSON line each (runs as a test user)."""
    workspace = tempfile.mkdtemp(prefix="corral-bench-")
    loop = asyncio.get_running_loop()
    box: Sandbox | None = None
    while True:
        request = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if not request:
            break
        result: Any = None
        if request == "ready":
            result = await ready_once(workspace)
        elif request == "raw":
            result = raw_once()
        elif request == "open":
            box = Sandbox(Policy(), workspace=workspace)
            await box.start()
            await box.run(["true"])  # the agent's first spawn imports subprocess
        elif request == "true" and box is not None:
            result = await time_true(box)
        print(json.dumps(result), flush=True)
    if box is not None:
        await box.aclose()


class Worker:
    def __init__(self, user: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        env["PYTHONPATH"] = str(REPO / "src")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.proc = subprocess.Popen(
            ["runuser", "-u", user, "--", sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )

    def ask(self, request: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker died on {request!r}")
        return json.loads(answer)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def available_users() -> dict[str, str]:
    found = {}
    for name, user in USERS.items():
        try:
            pwd.getpwnam(user)
        except KeyError:
            print(f"  ({name}: no user {user}; run `make setup` as root)")
            continue
        found[name] = user
    return found


async def main(runs: int) -> None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        sys.exit("bench_rootless.py runs as root (it switches to the test users with runuser)")
    users = available_users()
    workers = {name: Worker(user) for name, user in users.items()}
    ready: dict[str, list[float]] = {"root mode": [], **{name: [] for name in workers}}
    raw: list[float] = []
    try:
        await ready_once(None)  # first start: imports, agent .pyc, sweeps
        for w in workers.values():
            w.ask("ready")
        for _ in range(runs):
            ready["root mode"].append(await ready_once(None))
            for name, w in workers.items():
                ready[name].append(w.ask("ready"))
            if workers:
                raw.append(next(iter(workers.values())).ask("raw"))
        warm: dict[str, list[float]] = {name: [] for name in ready}
        async with Sandbox(Policy()) as box:
            await box.run(["true"])
            for w in workers.values():
                w.ask("open")
            for _ in range(runs * 5):
                warm["root mode"].append(await time_true(box))
                for name, w in workers.items():
                    warm[name].append(w.ask("true"))
    finally:
        for w in workers.values():
            w.close()
    print(f"create-to-ready ({runs} rounds, variants taking turns)")
    p50 = {name: line(name, samples) for name, samples in ready.items()}
    if raw:
        line("raw bwrap ... true (user)", raw)
    print(f"warm run (`true` in a box that is up, {runs * 5} rounds, taking turns)")
    warm50 = {name: line(name, samples) for name, samples in warm.items()}
    print("ratios to root mode")
    for name in workers:
        r, wr = p50[name] / p50["root mode"], warm50[name] / warm50["root mode"]
        verdict = "ok" if max(r, wr) <= TARGET else "over"
        print(f"  {name:<34} ready {r:5.2f}x   warm {wr:5.2f}x   (target <= {TARGET}x: {verdict})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    asyncio.run(worker() if args.worker else main(args.runs))
