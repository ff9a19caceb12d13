"""The image store's unpacking next to GNU tar, and what a cached or layer-sharing image
costs, measured in one run.

    python bench/bench_images.py [--tree /usr/lib/python3.11] [--rounds 3]

A gzip layer is made of ``--tree`` (a real tree: many small files, links); then, best of
``--rounds``:

* ``tar -xzf`` of the layer into an empty directory (the baseline: C, no checks);
* the store importing an OCI layout holding that layer (every entry placed beneath the root
  fd without following symlinks, the compressed and uncompressed digests checked, published
  by rename);
* resolving the same image again (stored: only the manifest is read);
* importing a second image made of the same layer plus a small one (the shared root is
  cloned by hard links, then the small layer applied), next to ``cp -a`` of the first root.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from corral.images.store import ImageStore


def _layout(path: Path, layers: list[tuple[bytes, str]]) -> None:
    """An OCI layout of (gzip blob, diff id) layers."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = {"rootfs": {"diff_ids": [d for _, d in layers]}, "config": {}}
    manifest = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": put(json.dumps(config).encode()),
        "layers": [put(blob) for blob, _ in layers],
    }
    (path / "index.json").write_text(
        json.dumps({"manifests": [put(json.dumps(manifest).encode())]})
    )
    (path / "oci-layout").write_text("{}")


def _best(rounds: int, fn: object) -> float:
    best = float("inf")
    for _ in range(rounds):
        assert callable(fn)
        best = min(best, fn())
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tree", default="/usr/lib/python3.11")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="corral-bench-images-"))
    try:
        tar_path = work / "layer.tar"
        subprocess.run(["tar", "-C", args.tree, "-cf", tar_path, "."], check=True)
        diff_id = "sha256:" + hashlib.sha256(tar_path.read_bytes()).hexdigest()
        gz = work / "layer.tar.gz"
        subprocess.run(["gzip", "-k", "-1", tar_path], check=True)
        blob = gz.read_bytes()
        with tarfile.open(tar_path) as t:
            entries = len(t.getmembers())
        small = io.BytesIO()
        with tarfile.open(fileobj=small, mode="w") as t:
            info = tarfile.TarInfo("added-by-top-layer")
            t.addfile(info, io.BytesIO(b""))
        import gzip

        small_blob = gzip.compress(small.getvalue())
        small_id = "sha256:" + hashlib.sha256(small.getvalue()).hexdigest()
        _layout(work / "one", [(blob, diff_id)])
        _layout(work / "two", [(blob, diff_id), (small_blob, small_id)])
        print(
            f"layer: {args.tree}, {entries} entries, {tar_path.stat().st_size >> 20} MiB tar, "
            f"{len(blob) >> 20} MiB gzip"
        )

        def gnu_tar() -> float:
            dest = work / "gnu"
            dest.mkdir()
            t0 = time.perf_counter()
            subprocess.run(["tar", "-xzf", gz, "-C", dest], check=True)
            dt = time.perf_counter() - t0
            shutil.rmtree(dest)
            return dt

        def cold() -> float:
            store = ImageStore(work / "store")
            t0 = time.perf_counter()
            store.resolve(str(work / "one"))
            dt = time.perf_counter() - t0
            shutil.rmtree(work / "store")
            return dt

        t_tar, t_cold = _best(args.rounds, gnu_tar), _best(args.rounds, cold)
        store = ImageStore(work / "store")
        store.resolve(str(work / "one"))

        def warm() -> float:
            t0 = time.perf_counter()
            store.resolve(str(work / "one"))
            return time.perf_counter() - t0

        def sharing() -> float:
            t0 = time.perf_counter()
            record = store.resolve(str(work / "two"))
            dt = time.perf_counter() - t0
            assert record is not None
            store.remove(record.ref)
            return dt

        first = store.rootfs(store.list()[0])

        def copy() -> float:
            t0 = time.perf_counter()
            subprocess.run(["cp", "-a", first, work / "copy"], check=True)
            dt = time.perf_counter() - t0
            shutil.rmtree(work / "copy")
            return dt

        t_warm, t_share, t_copy = (
            _best(args.rounds, warm),
            _best(args.rounds, sharing),
            _best(args.rounds, copy),
        )
        print(f"tar -xzf (baseline)          {t_tar * 1000:8.1f} ms")
        print(f"store import, cold           {t_cold * 1000:8.1f} ms  {t_cold / t_tar:5.2f}x tar")
        print(f"resolve, stored              {t_warm * 1000:8.1f} ms  {t_warm / t_tar:5.3f}x tar")
        print(
            f"second image sharing layer   {t_share * 1000:8.1f} ms  {t_share / t_copy:5.2f}x "
            f"cp -a of the root ({t_copy * 1000:.1f} ms)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
