"""A box's writable root as an image: an overlay upper directory (made here by the kernel's
own overlayfs on an image root) written as an OCI layer (corral.images.export) and committed
on top of the image (ImageStore.commit): deletions, opaque directories, symlinks that must not
be followed, hard links."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from corral.images.export import write_layer
from corral.images.store import ImageStore
from oci_images import Entry, busybox_root, dir_tar, layer_tar, write_layout

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or not Path("/bin/busybox").exists(),
    reason="mounts an overlay (root, unshare) on a busybox image",
)


def test_an_overlay_upper_dir_commits_as_a_layer(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    lower = layer_tar(
        [Entry("opt", "dir"), Entry("opt/old", data=b"old"), Entry("var", "dir"),
         Entry("var/gone", data=b"x")]
    )  # fmt: skip
    write_layout(tmp_path / "img", [dir_tar(busybox_root(tmp_path / "bb")), lower])
    base = store.resolve(str(tmp_path / "img"))
    assert base is not None
    upper, work, merged = (tmp_path / d for d in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    script = (
        f"mount -t overlay overlay -o lowerdir={store.rootfs(base)},upperdir={upper},"
        f"workdir={work} {merged} && cd {merged} && rm etc/hello var/gone && rm -r opt && "
        "mkdir opt && echo new > opt/new && echo data > a && ln a b && "
        "ln -s /etc/shadow evil && mkfifo pipe"
    )
    subprocess.run(["unshare", "-m", "sh", "-c", script], check=True, timeout=30)
    layer = tmp_path / "layer.tar"
    with open(layer, "wb") as out:
        assert write_layer(upper, out) > 0
    snap = store.commit("snap:1", base, [layer], {"Env": ["PATH=/bin"]}, source="snapshot")
    root = store.rootfs(snap)
    assert not (root / "etc" / "hello").exists() and not (root / "var" / "gone").exists()
    assert os.listdir(root / "opt") == ["new"]  # opaque: the old directory's files are gone
    assert os.readlink(root / "evil") == "/etc/shadow"
    assert (root / "a").stat().st_ino == (root / "b").stat().st_ino
    assert (root / "pipe").is_fifo()
    assert (root / "etc" / "passwd").is_file()  # the rest of the image is there
    # The image below is unchanged: the snapshot's root is its own.
    assert (store.rootfs(base) / "etc" / "hello").is_file()
    assert os.listdir(store.rootfs(base) / "opt") == ["old"]
    assert snap.layers[:2] == base.layers and len(snap.layers) == 3
