"""What ``corral run -- true`` costs without a server, next to its baselines in the same run.

    python bench/bench_cli_start.py [--runs N]

Each figure is the median of ``--runs`` runs (wall time, and the CPU time the process and
its children used, from ``getrusage``; on a busy machine the CPU figure is the steadier):

- ``python -c pass``: the interpreter's own start, the floor of any Python CLI;
- ``python: asyncio + a pydantic model``: the interpreter importing asyncio and pydantic and
  validating one model, as ``corral run`` imports them (``corral.cli.lean``: no pydantic
  plugin loader, no ssl under asyncio), the floor of a CLI built on an asyncio library whose
  policy is a pydantic model -- what ``corral run`` pays before any code of corral's;
- raw ``bwrap ... true``: a box's start and exit without corral;
- ``corral --version``: corral's command line up to argument parsing;
- ``corral run -- true``: the console script (the ``corral`` next to this interpreter) with
  ``CORRAL_HOST=local`` (in this process, never through a ``corral serve``): a box started
  with the default policy (network none), ``true`` run, the box torn down.

``--instructions`` adds the instructions each Python case executes (valgrind's callgrind,
the process's main thread and all its threads, children not followed), which the load on a
shared machine does not change; it takes a minute or two. valgrind (3.19) cannot start a box
(it lacks ``mount_setattr`` and ``pidfd_open``), so ``corral run -- true`` is counted up to
the box: its flags parsed, its policy built, and every module a real run loads imported in
the order the run loads them (taken from one real run first).

Ratios are against ``python -c pass`` and raw bwrap. Issue 16's target: ``corral run --
true`` with no server in at most 120 ms. Children run with bytecode caching on (as an
installed corral runs), whatever ``PYTHONDONTWRITEBYTECODE`` says here; one unmeasured run of
each command first writes the caches.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAW_BWRAP = [
    "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
    "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--", "true",
]  # fmt: skip
TARGET_MS = 120.0
FLOOR = """
from corral.cli.lean import lean_imports
lean_imports()
import asyncio
from pydantic import BaseModel
class M(BaseModel):
    x: int = 0
M(x=1)
"""


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(argv: list[str], runs: int, cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """Median wall and CPU seconds of ``argv`` (which must exit 0)."""
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(runs + 1):  # the first run warms caches and is not counted
        cpu = _cpu()
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, check=False)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}")
        walls.append(wall)
        cpus.append(_cpu() - cpu)
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


LOADED_BY_A_RUN = """
import json, sys
from corral.cli import main
assert main(["run", "--", "true"]) == 0
print(json.dumps(list(sys.modules)))
"""
UP_TO_THE_BOX = """
import importlib, json, sys
from corral.cli import make_parser
from corral.cli.lean import lean_imports
argv = ["run", "--", "true"]
args = make_parser(argv).parse_args(argv)
lean_imports()
from corral.cli.run import plan_run
plan_run(args)
for name in json.loads(sys.argv[1]):
    if name not in sys.modules:
        importlib.import_module(name)
"""


def instructions(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[int, int]:
    """Instructions of ``argv``'s main thread and of all its threads (callgrind)."""
    with tempfile.TemporaryDirectory(prefix="corral-bench-cg-") as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--separate-threads=yes",
             f"--callgrind-out-file={out}/cg", *argv],
            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
        )  # fmt: skip
        totals: dict[str, int] = {}
        for part in sorted(Path(out).iterdir()):
            for line in part.read_text().splitlines():
                if line.startswith("totals:"):
                    totals[part.name] = int(line.split()[1])
    return totals.get("cg-01", 0), sum(totals.values())


def corral_script() -> list[str]:
    script = Path(sys.executable).with_name("corral")
    return [str(script)] if script.exists() else [sys.executable, "-m", "corral"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument(
        "--instructions", action="store_true", help="also count instructions (valgrind)"
    )
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["CORRAL_HOST"] = "local"
    cases: list[tuple[str, list[str]]] = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("python: asyncio + a pydantic model", [sys.executable, "-c", FLOOR]),
        ("raw bwrap ... true", RAW_BWRAP),
        ("corral --version", [*corral_script(), "--version"]),
        ("corral run -- true", [*corral_script(), "run", "--", "true"]),
    ]
    if shutil.which("bwrap") is None:
        raise SystemExit("bwrap is not installed")
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as ws:
        os.chmod(ws, 0o755)
        results = {name: measure(argv, args.runs, ws, env) for name, argv in cases}
        counts = {}
        if args.instructions:
            loaded = subprocess.run(
                [sys.executable, "-c", LOADED_BY_A_RUN],
                cwd=ws, env=env, capture_output=True, text=True, check=True,
            ).stdout.splitlines()[-1]  # fmt: skip
            up_to_box = [sys.executable, "-c", UP_TO_THE_BOX, loaded]
            counted = [*cases[:2], cases[3], ("corral run -- true, up to the box", up_to_box)]
            counts = {name: instructions(argv, ws, env) for name, argv in counted}
    python_wall, python_cpu = results["python -c pass"]
    bwrap_wall, _ = results["raw bwrap ... true"]
    print(f"CLI start without a server (median of {args.runs}; wall and CPU in ms)")
    print(f"  {'':36} {'wall':>8} {'cpu':>8} {'/python':>8} {'/bwrap':>8}")
    for name, (wall, cpu) in results.items():
        print(
            f"  {name:36} {wall * 1e3:8.1f} {cpu * 1e3:8.1f} "
            f"{wall / python_wall:7.1f}x {wall / bwrap_wall:7.1f}x"
        )
    run_wall, run_cpu = results["corral run -- true"]
    floor_wall, floor_cpu = results["python: asyncio + a pydantic model"]
    print(
        f"  corral run -- true: {run_wall * 1e3:.0f} ms wall (target <= {TARGET_MS:.0f} ms), "
        f"{run_wall / python_wall:.1f}x python's start, CPU {run_cpu / python_cpu:.1f}x; "
        f"asyncio + pydantic alone: {floor_wall * 1e3:.0f} ms wall "
        f"({floor_cpu / run_cpu:.0%} of the run's CPU)"
    )
    if counts:
        print("Instructions (valgrind callgrind; millions): main thread, all threads")
        for name, (main_thread, every) in counts.items():
            print(f"  {name:36} {main_thread / 1e6:8.0f} {every / 1e6:8.0f}")


if __name__ == "__main__":
    main()
