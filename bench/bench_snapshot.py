"""Snapshot, fork and restore of a box with 100 MB of changes, next to ``cp -a`` of the same
data, measured in one run.

    python bench/bench_snapshot.py [--rounds N] [--mb M] [--forks K]

A box on a busybox image with a writable root writes ``--mb`` MB (64 files) under
``/opt/data`` and is forked once at once (what is not written back yet is flushed by that
first snapshot). Then, each round, in turn:

* ``cp -a`` of the box's upper layer to a fresh directory on the host's disk (the baseline:
  what copying the changed state costs; C, no checks);
* ``sb.snapshot(name)``: the box's changes kept as an image of the store;
* ``sb.fork(1)`` and ``sb.fork(K)``: a snapshot and boxes started from it, ready to run;
* ``Sandbox.restore(ref).start()``: a box on a snapshot;
* closing the forks;
* a new box on the image started, and ``K`` at once (the floor of a fork: boxes' starts).

Each figure is quoted as a ratio of the ``cp -a`` of the same round, and of a new box's start.
Where the copy-on-write store is off (``CORRAL_COW=0``: a tmpfs upper) a snapshot copies the
upper out as a layer and unpacks it: run it so too to see what the store saves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import line

from corral import Policy, Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from oci_images import busybox_root, dir_tar, write_layout

CPU: dict[str, list[float]] = {}
"""CPU per figure: this process (all its threads) and its children reaped meanwhile (``cp``;
a closed box's bwrap, with its whole life): what the load of a shared machine does not
inflate as it does wall-clock time. A box's agent and commands are not in it."""


def _cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


class _Timed:
    def __init__(self, name: str, figures: dict[str, list[float]]) -> None:
        self.name, self.figures = name, figures

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _cpu()

    def __exit__(self, *exc: object) -> None:
        self.figures[self.name].append(time.perf_counter() - self.wall)
        CPU.setdefault(self.name, []).append(_cpu() - self.cpu)


def _cp(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--forks", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-snap-", dir="/var/tmp"))
    os.environ["CORRAL_IMAGE_STORE"] = str(tmp / "store")
    figures: dict[str, list[float]] = {
        "cp -a": [],
        "snapshot": [],
        "fork(1)": [],
        f"fork({args.forks})": [],
        "restore (start)": [],
        f"close {args.forks} forks": [],
        "new box (start)": [],
        f"{args.forks} new boxes at once": [],
    }
    try:
        root = busybox_root(tmp / "root")
        layout = str(write_layout(tmp / "layout", [dir_tar(root)]).path)
        (tmp / "ws").mkdir()
        files = 64
        each = args.mb * (1 << 20) // files
        write = (
            f"mkdir -p /opt/data && for i in $(busybox seq {files}); do "
            f"busybox head -c {each} /dev/urandom > /opt/data/f$i; done"
        )
        policy = Policy(image=layout, user="root", filesystem={"root_size": f"{args.mb * 2}M"})
        async with Sandbox(policy, workspace=tmp / "ws") as sb:
            r = await sb.run(["/bin/sh", "-c", write], cwd="/")
            assert r.exit_code == 0, r
            layer = sb._box.root_layer if sb._box else None
            assert layer is not None
            t = time.perf_counter()  # right after the writes: what is still dirty goes first
            (first,) = await sb.fork(1)
            first_fork = time.perf_counter() - t
            await first.aclose()
            for i in range(args.rounds):
                with _Timed("cp -a", figures):
                    await asyncio.to_thread(_cp, layer.upper, tmp / f"copy{i}")
                shutil.rmtree(tmp / f"copy{i}")

                with _Timed("snapshot", figures):
                    ref = await sb.snapshot(f"localhost/bench/snap:{i}")

                with _Timed("fork(1)", figures):
                    one = await sb.fork(1)
                with _Timed(f"fork({args.forks})", figures):
                    many = await sb.fork(args.forks)
                check = await many[-1].run("busybox du -sm /opt/data")
                assert check.stdout.split()[0] in (str(args.mb), str(args.mb + 1)), check

                restored = Sandbox.restore(ref, policy)
                with _Timed("restore (start)", figures):
                    await restored.start()

                with _Timed(f"close {args.forks} forks", figures):
                    await asyncio.gather(*(f.aclose() for f in many))
                await asyncio.gather(restored.aclose(), *(f.aclose() for f in one))

                fresh = Sandbox(policy)
                with _Timed("new box (start)", figures):
                    await fresh.start()
                await fresh.aclose()
                news = [Sandbox(policy) for _ in range(args.forks)]
                with _Timed(f"{args.forks} new boxes at once", figures):
                    await asyncio.gather(*(b.start() for b in news))
                await asyncio.gather(*(b.aclose() for b in news))
        load = os.getloadavg()[0]
        print(
            f"{args.mb} MB in {files} files changed above the image, {args.rounds} rounds "
            f"(load {load:.1f}):"
        )
        from corral.backends.host import cowstore

        store = "copy-on-write store" if cowstore.mounted() else "tmpfs uppers (no cow store)"
        print(f"writable roots: {store}")
        base = line("cp -a of the upper (baseline)", figures["cp -a"])
        print(f"  {'':<34} CPU {statistics.median(CPU['cp -a']) * 1000:.1f} ms")
        start = statistics.median(figures["new box (start)"]) * 1000
        print(
            f"  {'first fork(1), right after writing':<34} {first_fork * 1000:8.2f} ms"
            f"   x{first_fork * 1000 / base:.2f} of cp -a, x{first_fork * 1000 / start:.2f} of a"
            " box's start"
        )
        for name, samples in list(figures.items())[1:]:
            p50 = line(name, samples)
            cpu = statistics.median(CPU[name]) * 1000
            print(
                f"  {'':<34} x{p50 / base:.2f} of cp -a, x{p50 / start:.2f} of a box's start;"
                f" CPU {cpu:.1f} ms"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
