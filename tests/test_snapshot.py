"""Snapshots and fork: a box's writable root becomes an image others start from; forks
diverge; the box snapshotted goes on; filesystem state only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from corral import Policy, Sandbox, SandboxError
from corral.images.store import ImageStore
from oci_images import busybox_root, dir_tar, write_layout

pytestmark = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="writable image roots run on bwrap as root"),
]


@pytest.fixture
def image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = busybox_root(tmp_path / "rootfs")
    (root / "etc").mkdir(exist_ok=True)
    write_layout(tmp_path / "layout", [dir_tar(root)])
    return str(tmp_path / "layout")


async def test_a_snapshot_restores_and_forks_diverge(image: str, tmp_path: Path) -> None:
    policy = Policy(image=image, user="root")
    (tmp_path / "ws0").mkdir()
    async with Sandbox(policy, workspace=tmp_path / "ws0") as sb:
        await sb.run("echo configured > /etc/app.conf && mkdir -p /data && echo 1 > /data/n")
        ref = await sb.snapshot("localhost/corral-test/snap:1")
        assert not sb.paused  # it went on after the snapshot
        assert (await sb.run("echo after > /etc/later && cat /etc/app.conf")).exit_code == 0
        async with Sandbox.restore(ref, policy) as restored:
            r = await restored.run("cat /etc/app.conf /data/n; ls /etc")
            assert r.stdout.startswith("configured\n1\n"), r
            assert "later" not in r.stdout  # written after the snapshot
        forks = await sb.fork(2)
        try:
            for i, fork in enumerate(forks):
                await fork.run(f"echo fork{i} > /data/mine")
            seen = [(await f.run("cat /data/mine /etc/app.conf")).stdout for f in forks]
            assert seen == ["fork0\nconfigured\n", "fork1\nconfigured\n"]
            assert (await sb.run("cat /data/mine 2>&1 || echo none")).stdout.endswith("none\n")
        finally:
            for fork in forks:
                await fork.aclose()


async def test_a_snapshot_needs_an_image_of_the_store(tmp_path: Path) -> None:
    async with Sandbox(workspace=tmp_path) as sb:  # the host's root: nothing to snapshot
        with pytest.raises(SandboxError):
            await sb.snapshot("localhost/corral-test/nothing:1")


async def test_snapshot_and_fork_through_the_server(image: str, tmp_path: Path) -> None:
    import corral
    from served import serving

    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        async with corral.connect(served.url) as remote:
            async with remote.Sandbox(Policy(image=image, user="root")) as sb:
                await sb.run("echo base > /etc/state")
                forks = await sb.fork(2)
                for i, fork in enumerate(forks):
                    await fork.run(f"echo fork{i} >> /etc/state")
                states = [(await f.run("cat /etc/state")).stdout for f in forks]
                assert states == ["base\nfork0\n", "base\nfork1\n"]
                ref = await sb.snapshot("localhost/corral-test/remote:1")
                assert ref == "localhost/corral-test/remote:1"
                for fork in forks:
                    await fork.aclose()
            assert await remote.boxes() == []


async def test_a_hostile_writable_root_is_snapshotted_safely(image: str, tmp_path: Path) -> None:
    """Everything in the upper is the box's: a link to the host's /etc/shadow stays a link,
    setuid bits (which the box cannot set anyway) are not kept, no device node reaches the store."""
    (tmp_path / "ws").mkdir()
    async with Sandbox(Policy(image=image, user="root"), workspace=tmp_path / "ws") as sb:
        r = await sb.run(
            "ln -s /etc/shadow /etc/evil && mkfifo /etc/fifo && echo x > /etc/suid"
            " && (chmod 4755 /etc/suid; mknod /etc/dev c 1 3; true)"
        )
        assert r.exit_code == 0, r
        ref = await sb.snapshot("localhost/corral-test/hostile:1")
    store = ImageStore()
    record = store.get(ref)
    assert record is not None
    etc = store.rootfs(record) / "etc"
    assert os.readlink(etc / "evil") == "/etc/shadow"  # copied as a link, never followed
    assert stat.S_IMODE((etc / "suid").lstat().st_mode) & (stat.S_ISUID | stat.S_ISGID) == 0
    for entry in etc.iterdir():
        mode = entry.lstat().st_mode
        assert not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)), entry
