"""Rootless boxes next to root mode and raw unprivileged bwrap, in one run.

    python bench/bench_rootless.py [--runs N] [--backends bwrap,oci-crun,oci-runc]
                                      # as root; `make setup` made the test users

create-to-ready: from ``Sandbox.start()`` until the guest agent is ready (as in
bench_backends.py). warm run: ``run(["true"])`` in a box that is up. Root mode runs in this
process; each rootless variant in a worker process of its own, run as an unprivileged test
user (``corral-rootless``: subordinate ids, newuidmap/newgidmap; ``corral-nosubid``: one id),
driven round by round over a pipe, so every variant takes its turn in each round and a busy
neighbour slows them alike. "raw bwrap (user)" is ``bwrap --unshare-all ... true`` run by that
user: the floor of any unprivileged sandbox here. The checkout must be readable by the test
users (it is bound read-only for them by tests/test_rootless.py; here it is used in place).

``--backends``: each backend's root mode and rootless variants take turns in every round
(``oci-crun``, ``oci-runc``: the OCI backend, rootless through corral.backends.oci.rootless),
so OCI rootless is measured next to OCI root mode and bwrap in the same run.
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
BACKENDS = {
    "bwrap": {},
    "oci-crun": {"backend": "oci", "runtime": "crun"},
    "oci-runc": {"backend": "oci", "runtime": "runc"},
}


def policy(backend: str) -> Policy:
    return Policy.from_dict(BACKENDS[backend])


async def ready_once(workspace: str | None, backend: str = "bwrap") -> float:
    box = Sandbox(policy(backend), workspace=workspace)
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
    boxes: dict[str, Sandbox] = {}
    while True:
        request, _, backend = (await loop.run_in_executor(None, sys.stdin.readline)).partition(" ")
        request, backend = request.strip(), backend.strip() or "bwrap"
        if not request:
            break
        result: Any = None
        if request == "ready":
            result = await ready_once(workspace, backend)
        elif request == "raw":
            result = raw_once()
        elif request == "open":
            box = boxes[backend] = Sandbox(policy(backend), workspace=workspace)
            await box.start()
            await box.run(["true"])  # the agent's first spawn imports subprocess
        elif request == "true" and backend in boxes:
            result = await time_true(boxes[backend])
        print(json.dumps(result), flush=True)
    for box in boxes.values():
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


async def warm_runs(
    rounds: int, backends: list[str], workers: dict[str, Worker], names: list[str]
) -> dict[str, list[float]]:
    """``true`` in a box that is up, every variant in turn each round."""
    warm: dict[str, list[float]] = {name: [] for name in names}
    root_boxes = {b: Sandbox(policy(b)) for b in backends}
    try:
        for b, box in root_boxes.items():
            await box.start()
            await box.run(["true"])
            for w in workers.values():
                w.ask(f"open {b}")
        for _ in range(rounds):
            for b, box in root_boxes.items():
                warm[label(b, "root mode")].append(await time_true(box))
                for name, w in workers.items():
                    warm[label(b, name)].append(w.ask(f"true {b}"))
    finally:
        for box in root_boxes.values():
            await box.aclose()
    return warm


def label(backend: str, mode: str) -> str:
    return mode if backend == "bwrap" else f"{backend}: {mode.replace('subordinate ', 'sub')}"


async def main(runs: int, backends: list[str]) -> None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        sys.exit("bench_rootless.py runs as root (it switches to the test users with runuser)")
    users = available_users()
    workers = {name: Worker(user) for name, user in users.items()}
    modes = ["root mode", *workers]
    ready: dict[str, list[float]] = {label(b, m): [] for b in backends for m in modes}
    raw: list[float] = []
    try:
        for b in backends:  # first start: imports, agent .pyc, sweeps
            await ready_once(None, b)
            for w in workers.values():
                w.ask(f"ready {b}")
        for _ in range(runs):
            for b in backends:
                ready[label(b, "root mode")].append(await ready_once(None, b))
                for name, w in workers.items():
                    ready[label(b, name)].append(w.ask(f"ready {b}"))
            if workers:
                raw.append(next(iter(workers.values())).ask("raw"))
        warm = await warm_runs(runs * 5, backends, workers, list(ready))
    finally:
        for w in workers.values():
            w.close()
    report(runs, backends, list(workers), ready, warm, raw)


def report(
    runs: int,
    backends: list[str],
    rootless: list[str],
    ready: dict[str, list[float]],
    warm: dict[str, list[float]],
    raw: list[float],
) -> None:
    print(f"create-to-ready ({runs} rounds, variants taking turns)")
    p50 = {name: line(name, samples) for name, samples in ready.items()}
    if raw:
        line("raw bwrap ... true (user)", raw)
    print(f"warm run (`true` in a box that is up, {runs * 5} rounds, taking turns)")
    warm50 = {name: line(name, samples) for name, samples in warm.items()}
    print("ratios to the same backend's root mode")
    for b in backends:
        base = label(b, "root mode")
        for name in rootless:
            row = label(b, name)
            r, wr = p50[row] / p50[base], warm50[row] / warm50[base]
            verdict = "ok" if max(r, wr) <= TARGET else "over"
            ratios = f"ready {r:5.2f}x   warm {wr:5.2f}x"
            print(f"  {row:<34} {ratios}   (target <= {TARGET}x: {verdict})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    choices = ",".join(BACKENDS)
    parser.add_argument("--backends", default="bwrap", help=f"comma-separated: {choices}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    chosen = [b for b in args.backends.split(",") if b]
    if unknown := [b for b in chosen if b not in BACKENDS]:
        parser.error(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    asyncio.run(worker() if args.worker else main(args.runs, chosen))
