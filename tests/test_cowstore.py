"""The copy-on-write store's own life, on a store of the test's own (a fresh btrfs file
loop-mounted under tmp_path): made on first use, leftovers of dead processes and of image
stores that are gone swept, snapshots an image store still records kept, and a file that no
longer mounts set aside and made anew."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.host import cowstore, mounts

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or cowstore._unusable() is not None,
    reason="the copy-on-write store needs root, mkfs.btrfs and btrfs",
)


@pytest.fixture
def own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    target, file = tmp_path / "mnt", tmp_path / "cache" / "cow.btrfs"
    monkeypatch.setattr(cowstore, "mount_point", lambda: target)
    monkeypatch.setattr(cowstore, "image_file", lambda: file)
    monkeypatch.setenv("CORRAL_COW_SIZE", str(1 << 30))
    monkeypatch.setattr(cowstore, "_ready", None)
    monkeypatch.setattr(cowstore, "_failed", None)
    try:
        yield target
    finally:
        with contextlib.suppress(OSError):
            mounts.umount_all(str(target))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _age(path: Path) -> None:
    old = time.time() - 3600
    os.utime(path, (old, old))


def test_the_store_is_made_swept_and_made_anew(own_store: Path, tmp_path: Path) -> None:
    root = cowstore.root()
    assert root == own_store and cowstore._is_btrfs(root)
    assert (root.stat().st_mode & 0o777) == 0o700
    # its dirty data is capped (what a snapshot flushes first)
    loop = subprocess.run(
        ["findmnt", "-no", "SOURCE", str(root)], capture_output=True, text=True, check=True
    ).stdout.strip()
    (fs,) = [
        p for p in Path("/sys/fs/btrfs").glob("*-*") if (p / "devices" / Path(loop).name).exists()
    ]
    if (fs / "bdi" / "max_bytes").exists():
        assert (fs / "bdi" / "strict_limit").read_text().strip() == "1"
        assert abs(int((fs / "bdi" / "max_bytes").read_text()) - cowstore.DIRTY_CAP) < 1 << 16
    # a box of a process that died, and a live one
    cowstore.new_box_subvolume(root, "box-dead", None, 1 << 20)
    (root / "boxes" / "box-dead.json").write_text(json.dumps({"host_pid": _dead_pid()}))
    cowstore.new_box_subvolume(root, "box-live", None, 1 << 20)
    # snapshots: of an image store that is gone, of one that records it, of one that forgot
    store = tmp_path / "images"
    (store / "refs").mkdir(parents=True)
    (store / "refs" / "a.json").write_text(json.dumps({"ref": "x/a:1", "cow": "kept"}))
    for name, owner in (("gone", tmp_path / "nowhere"), ("kept", store), ("forgot", store)):
        cowstore.take_snapshot(root, root / "boxes" / "box-live", name, owner, [])
        _age(root / "snaps" / f"{name}.json")
    cowstore.take_snapshot(root, root / "boxes" / "box-live", "young", tmp_path / "x", [])

    assert sorted(cowstore.sweep()) == ["box-dead", "forgot", "gone"]
    assert sorted(p.name for p in (root / "boxes").iterdir()) == ["box-live", "box-live.json"]
    left = sorted(p.name for p in (root / "snaps").iterdir())
    assert left == ["kept", "kept.json", "young", "young.json"]  # young: being recorded

    cowstore.release_box(root, "box-live")
    assert list((root / "boxes").iterdir()) == []

    # A store that no longer mounts (a host crash without barriers): set aside, made anew
    mounts.umount_all(str(root))
    file = cowstore.image_file()
    file.unlink()  # a new inode: a loop device the kernel has not let go yet is not reused
    with open(file, "wb") as f:
        f.truncate(1 << 30)  # no superblock
    cowstore._ready = None
    again = cowstore.root()
    assert again == own_store and cowstore._is_btrfs(again)
    assert (file.parent / "cow.btrfs.unmountable").is_file()
    assert list((again / "snaps").iterdir()) == []
