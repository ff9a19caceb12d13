"""The image store as an ordinary user: no chown, and an image's read-only (0555) directory
must still take the next layer's files, and ``rm`` must still remove it."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from corral import errors
from corral.images.store import ImageStore


def _layer(entries: list[tuple[str, str, int]]) -> bytes:
    """(name, kind, mode): kind is a file's content, "/" for a directory, "chr" a device."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            data = None
            if kind == "/":
                info.type = tarfile.DIRTYPE
            elif kind == "chr":
                info.type = tarfile.CHRTYPE
            else:
                info.size = len(kind)
                data = io.BytesIO(kind.encode())
            tar.addfile(info, data)
    return buf.getvalue()


def _layout(path: Path, layers: list[bytes]) -> None:
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = {"rootfs": {"diff_ids": [put(t)["digest"] for t in layers]}, "config": {}}
    manifest = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": put(json.dumps(config).encode()),
        "layers": [put(gzip.compress(t)) for t in layers],
    }
    index = {"manifests": [put(json.dumps(manifest).encode())]}
    (path / "index.json").write_text(json.dumps(index))
    (path / "oci-layout").write_text("{}")


def test_an_ordinary_user_unpacks_read_only_directories_and_removes_them(
    tmp_path: Path,
) -> None:
    assert os.geteuid() != 0
    lower = _layer([("ro", "/", 0o555), ("ro/a", "a", 0o444)])
    _layout(tmp_path / "img", [lower, _layer([("ro/b", "b", 0o644), ("ro/.wh.a", "", 0)])])
    store = ImageStore(tmp_path / "store")
    record = store.resolve(str(tmp_path / "img"))
    assert record is not None
    ro = store.rootfs(record) / "ro"
    assert sorted(os.listdir(ro)) == ["b"] and ro.stat().st_mode & 0o777 == 0o555
    _layout(tmp_path / "bad", [lower, _layer([("ro/c", "c", 0o644), ("sda", "chr", 0o600)])])
    with pytest.raises(errors.UnsafeLayer, match="device node"):
        store.resolve(str(tmp_path / "bad"))
    assert os.listdir(store.root / "tmp") == []
    store.remove(record.ref)
    assert os.listdir(store.root / "roots") == []
