"""What a box on an image root costs next to one on the host's root, measured in one run.

    python bench/bench_image_root.py [--runs N] [--mb M]

Start to ready and close, each box closed before the next starts; the kinds take turns round
by round, so a noisy neighbour on this shared machine slows all of them alike:

* ``host``: today's default (the host's system, read-only): the baseline;
* ``image ro``: a busybox image from the store, read-only (``root_size = None``);
* ``image rw``: the same image with a writable root (the default: idmapped lower, tmpfs upper,
  overlay);
* ``image rw root``: the same, commands as box root.

Then, in one box with a writable root, ``--mb`` MB written under ``/opt`` (64 files) and
``Sandbox.export_root`` of them as a layer, next to ``tar -cf`` of the same files on the host
(the baseline: C, no checks), and ``ImageStore.commit`` of that layer on the image.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import line

from corral import Policy, Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from oci_images import busybox_root, dir_tar, write_layout


async def measure(policy: Policy, workspace: Path) -> tuple[float, float]:
    box = Sandbox(policy, workspace=workspace)
    t = time.perf_counter()
    await box.start()
    ready = time.perf_counter() - t
    t = time.perf_counter()
    await box.aclose()
    return ready, time.perf_counter() - t


def _tar(src: Path, dest: Path) -> None:
    subprocess.run(["tar", "-cf", str(dest), "-C", str(src), "."], check=True)


async def export_figures(layout: str, workspace: Path, tmp: Path, mb: int) -> None:
    from corral.images.store import ImageStore

    files = 64
    each = mb * (1 << 20) // files
    write = (
        f"mkdir -p /opt/data && for i in $(busybox seq {files}); do "
        f"busybox head -c {each} /dev/urandom > /opt/data/f$i; done"
    )
    policy = Policy(image=layout, user="root", filesystem={"root_size": f"{mb * 2}M"})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["/bin/sh", "-c", write], cwd="/")
        assert r.exit_code == 0, r
        t = time.perf_counter()
        await sb.export_root(tmp / "layer.tar")
        export = time.perf_counter() - t
        layer = sb._box.root_layer if sb._box else None
        assert layer is not None
        t = time.perf_counter()
        await asyncio.to_thread(_tar, layer.upper, tmp / "plain.tar")
        tar = time.perf_counter() - t
    store = ImageStore()
    base = store.resolve(layout)
    t = time.perf_counter()
    store.commit("bench/commit:1", base, [tmp / "layer.tar"], {})
    commit = time.perf_counter() - t
    store.remove("bench/commit:1")
    print(f"\n{mb} MB in {files} files changed above the image:")
    print(f"  tar -cf of the upper (baseline)      {tar * 1000:8.1f} ms")
    print(f"  Sandbox.export_root                  {export * 1000:8.1f} ms   x{export / tar:.2f}")
    print(f"  ImageStore.commit of that layer      {commit * 1000:8.1f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-image-"))
    os.environ["CORRAL_IMAGE_STORE"] = str(tmp / "store")
    try:
        root = busybox_root(tmp / "root")
        layout = str(write_layout(tmp / "layout", [dir_tar(root)]).path)
        workspace = tmp / "ws"
        workspace.mkdir()
        kinds = {
            "host": Policy(),
            "image ro": Policy(image=layout, filesystem={"root_size": None}),
            "image rw": Policy(image=layout),
            "image rw root": Policy(image=layout, user="root"),
        }
        ready: dict[str, list[float]] = {k: [] for k in kinds}
        close: dict[str, list[float]] = {k: [] for k in kinds}
        for policy in kinds.values():  # warm up: the store import, the interpreter's caches
            await measure(policy, workspace)
        for _ in range(args.runs):
            for name, policy in kinds.items():
                r, c = await measure(policy, workspace)
                ready[name].append(r)
                close[name].append(c)
        load = os.getloadavg()[0]
        print(f"create-to-ready and close, {args.runs} rounds, kinds in turn (load {load:.1f}):")
        base = line("host: ready", ready["host"])
        for name in list(kinds)[1:]:
            p50 = line(f"{name}: ready", ready[name])
            print(f"  {'':<34} x{p50 / base:.2f} of host")
        base = line("host: close", close["host"])
        for name in list(kinds)[1:]:
            p50 = line(f"{name}: close", close[name])
            print(f"  {'':<34} x{p50 / base:.2f} of host")
        await export_figures(layout, workspace, tmp, args.mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
