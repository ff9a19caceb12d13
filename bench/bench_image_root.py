"""What a box on an image root costs next to one on the host's root, measured in one run.

    python bench/bench_image_root.py [--runs N] [--mb M] [--backends bwrap,oci-crun,oci-runc]

Start to ready, close, and the host CPU time of both (this process's threads and its reaped
children: the runtime, bwrap's monitor; not the box's own processes), each box closed before
the next starts; the kinds take turns round
by round, so a noisy neighbour on this shared machine slows all of them alike. Per backend:

* ``host``: today's default (the host's system, read-only): that backend's baseline;
* ``image ro``: a busybox image from the store, read-only (``root_size = None``);
* ``image rw``: the same image with a writable root (the default: idmapped lower, tmpfs upper,
  overlay);
* ``image rw root``: the same, commands as box root (not on ``bwrap-rootless``).

``--backends microvm`` (seconds a box under TCG: use few ``--runs``) measures the microVM.
As an ordinary user ``--backends bwrap-rootless`` measures rootless bwrap (the overlay mounted
in the box's own namespace) the same way; export figures need root.

Then, in one box with a writable root, ``--mb`` MB written under ``/opt`` (64 files) and
``Sandbox.export_root`` of them as a layer, next to ``tar -cf`` of the same files on the host
(the baseline: C, no checks), and ``ImageStore.commit`` of that layer on the image.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
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


def _cpu() -> float:
    """CPU seconds of this process (every thread: the host's mounts) and of its reaped
    children (the runtime, bwrap's monitor): steadier than wall-clock on a loaded host."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


async def measure(policy: Policy, workspace: Path) -> tuple[float, float, float]:
    box = Sandbox(policy, workspace=workspace)
    cpu = _cpu()
    t = time.perf_counter()
    await box.start()
    ready = time.perf_counter() - t
    t = time.perf_counter()
    await box.aclose()
    return ready, time.perf_counter() - t, _cpu() - cpu


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
    parser.add_argument("--backends", default="bwrap,oci-crun,oci-runc")
    parser.add_argument("--no-export", action="store_true")
    args = parser.parse_args()
    backends = {
        "bwrap": {},
        "bwrap-rootless": {},
        "oci-crun": {"backend": "oci", "runtime": "crun"},
        "oci-runc": {"backend": "oci", "runtime": "runc"},
        "microvm": {"backend": "microvm"},
    }
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-image-"))
    os.environ["CORRAL_IMAGE_STORE"] = str(tmp / "store")
    try:
        root = busybox_root(tmp / "root")
        layout = str(write_layout(tmp / "layout", [dir_tar(root)]).path)
        workspace = tmp / "ws"
        workspace.mkdir()
        kinds: dict[str, Policy] = {}
        for b in args.backends.split(","):
            on = backends[b]
            kinds[f"{b} host"] = Policy(**on)
            kinds[f"{b} image ro"] = Policy(image=layout, filesystem={"root_size": None}, **on)
            kinds[f"{b} image rw"] = Policy(image=layout, **on)
            if b not in ("bwrap-rootless", "microvm"):  # box root refused there
                kinds[f"{b} image rw root"] = Policy(image=layout, user="root", **on)
        ready: dict[str, list[float]] = {k: [] for k in kinds}
        close: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for policy in kinds.values():  # warm up: the store import, the interpreter's caches
            await measure(policy, workspace)
        for _ in range(args.runs):
            for name, policy in kinds.items():
                r, c, used = await measure(policy, workspace)
                ready[name].append(r)
                close[name].append(c)
                cpu[name].append(used)
        load = os.getloadavg()[0]
        print(f"create-to-ready and close, {args.runs} rounds, kinds in turn (load {load:.1f}):")
        for what, figures in (("ready", ready), ("close", close), ("host CPU", cpu)):
            base = 0.0
            for name in kinds:
                p50 = line(f"{name}: {what}", figures[name])
                if name.endswith(" host"):
                    base = p50
                else:
                    print(f"  {'':<34} x{p50 / base:.2f} of {name.split()[0]} host")
        if not args.no_export and os.geteuid() == 0:
            await export_figures(layout, workspace, tmp, args.mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
