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


@pytest.mark.parametrize("backend", [{}, {"backend": "oci", "runtime": "crun"}])
async def test_a_box_runs_on_an_image_with_a_writable_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: dict[str, str]
) -> None:
    """Rootless bwrap and rootless crun on an image without Python from the user's own
    store: the overlay mounted in the box's (or the runtime's) own user namespace, a tmpfs
    of root_size above the image, the agent run by the host's interpreter; what the box
    changes is gone with it, the image in the store unchanged; a read-only root; box root
    refused naming the field."""
    import shutil

    from corral import BackendUnavailable, Policy, Sandbox

    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(busybox):
        pytest.skip("busybox-static is not installed")
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "rm", "dd", "id"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "hello").write_text("from the image\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    _layout(tmp_path / "img", [buf.getvalue()])
    if backend and shutil.which(backend["runtime"]) is None:
        pytest.skip(f"{backend['runtime']} is not installed")
    policy = Policy(image=str(tmp_path / "img"), filesystem={"root_size": "2M"}, **backend)
    async with Sandbox(policy) as sb:
        r = await sb.run(
            "cat /etc/hello; command -v python3 || echo no-python; echo changed > /etc/hello "
            "&& rm /bin/dd && cat /etc/hello; busybox dd if=/dev/zero of=/etc/big bs=1M "
            "count=8 2>&1; echo dd=$?",
            cwd="/",
        )
        assert r.stdout.startswith("from the image\nno-python\nchanged\n"), r
        assert "No space left on device" in r.stdout and "dd=1" in r.stdout, r
        assert (await sb.info())["image"]["writable"] is True
    store = ImageStore(tmp_path / "store")
    record = store.resolve(str(tmp_path / "img"))
    assert record is not None
    stored = store.rootfs(record)
    assert (stored / "etc" / "hello").read_text() == "from the image\n"
    assert (stored / "bin" / "dd").is_symlink()
    read_only = Policy(image=str(tmp_path / "img"), filesystem={"root_size": None}, **backend)
    async with Sandbox(read_only) as sb:
        r = await sb.run("cat /etc/hello; (echo x > /etc/hello) 2>&1", cwd="/")
        assert r.stdout.startswith("from the image\n") and "Read-only" in r.stdout, r
    with pytest.raises(BackendUnavailable, match=r"policy\.user"):
        async with Sandbox(Policy(image=str(tmp_path / "img"), user="root", **backend)):
            pass
