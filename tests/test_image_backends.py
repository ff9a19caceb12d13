"""Boxes on an image beyond the bwrap backend as root: the OCI backend (runc, crun) runs an
image without Python from the store with its config honoured, a writable root capped by
``filesystem.root_size``, box root and the box user as on bwrap, the image on the host
unchanged; backends that cannot refuse with ``backend_unavailable`` naming the field."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from conftest import backend_policy, backend_skip
from corral import BackendUnavailable, Sandbox
from corral.backends.host.state import state_root
from oci_images import busybox_root, dir_tar, write_layout

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/bin/busybox"),
    reason="images run as root on the host; needs busybox-static",
)

IMAGE_BACKENDS = ["oci-runc", "oci-crun"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout of a busybox root (no Python, no libc) with a config: Env, a
    WorkingDir the image has (uid 1000's), no User."""
    tmp = tmp_path_factory.mktemp("image")
    root = busybox_root(tmp / "root")
    (root / "srv" / "app").mkdir(parents=True)
    os.chown(root / "srv" / "app", 1000, 1000)
    config: dict[str, object] = {
        "Env": ["PATH=/bin", "GREETING=from-image"],
        "WorkingDir": "/srv/app",
    }
    return write_layout(tmp / "layout", [dir_tar(root)], config=config).path


def snapshot(root: Path) -> list[tuple[str, int, int, int, bytes]]:
    out = []
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        out.append((str(p.relative_to(root)), st.st_mode, st.st_uid, st.st_size, data[:64]))
    return out


@pytest.mark.parametrize("backend", IMAGE_BACKENDS)
async def test_an_image_without_python_runs_with_a_writable_root(
    backend: str,
    layout: Path,
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One box as the box user, one as box root with a small root: the image's config,
    the hidden interpreter, who may write what, the cap, the exported layer; the image
    in the store unchanged and every staging mount gone."""
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(store))
    policy = backend_policy(backend, image=str(layout))
    ws = tmp_path / "ws"
    ws.mkdir()
    async with Sandbox(policy, workspace=ws) as sb:
        r = await sb.run(
            'echo "$GREETING $PATH"; pwd; id -u; command -v python3 || echo no-python; '
            "cat /etc/hello; touch /etc/x 2>&1; touch mine && stat -c %u mine; "
            "ls /run/corral 2>&1; echo hi > /workspace/out"
        )
        assert r.stdout.splitlines()[:5] == [
            "from-image /bin",
            "/srv/app",  # the image's WorkingDir
            "1000",
            "no-python",
            "hello from the image",
        ], r
        assert "Permission denied" in r.stdout and "1000\n" in r.stdout, r
        assert r.stdout.count("Permission denied") == 2, r  # /etc, and /run/corral
        assert (ws / "out").read_text() == "hi\n"
        assert (await sb.info())["image"]["writable"] is True
    from corral.images import resolve_image

    rootfs = resolve_image(str(layout)).rootfs
    assert rootfs is not None
    before = snapshot(rootfs)
    small = backend_policy(backend, image=str(layout), user="root", filesystem={"root_size": "2M"})
    async with Sandbox(small, workspace=ws) as sb:
        r = await sb.run(
            "id -u; echo changed > /etc/hello && rm /bin/rm && mkdir /data && cat /etc/hello; "
            "dd if=/dev/zero of=/etc/big bs=1M count=8 2>&1; echo dd=$?",
            cwd="/",
        )
        assert r.stdout.startswith("0\nchanged\n"), r
        # ENOSPC on a tmpfs upper, EDQUOT (the qgroup) on the copy-on-write store's
        full = ("No space left on device", "Disk quota exceeded")
        assert any(f in r.stdout for f in full) and "dd=1" in r.stdout, r
        tar = tmp_path / "changes.tar"
        await sb.run("rm -f /etc/big")
        await sb.export_root(str(tar))
        with tarfile.open(tar) as t:
            names = set(t.getnames())
        assert {"etc/hello", "bin/.wh.rm", "data"} <= names, names
        assert not names & {"workspace", "proc", "dev", "tmp", "run", "home", "sys"}, names
    assert snapshot(rootfs) == before  # the image in the store is unchanged
    mine = list((state_root() / "mnt").glob(f"{sb.sandbox_id}.*"))
    assert not mine, mine


@pytest.mark.parametrize("backend", IMAGE_BACKENDS[:1])
async def test_a_read_only_image_root(backend: str, tmp_path: Path) -> None:
    root = busybox_root(tmp_path / "root")
    policy = backend_policy(backend, image=str(root), filesystem={"root_size": None})
    async with Sandbox(policy, workspace=tmp_path / "root" / "etc") as sb:
        r = await sb.run("cat /etc/hello; id -un; touch /bin/x 2>&1; ls /", cwd="/")
        assert r.stdout.startswith("hello from the image\nuser\n"), r  # the box's passwd
        assert "Read-only file system" in r.stdout and "workspace" in r.stdout, r
        assert (await sb.info())["image"]["writable"] is False


@pytest.mark.parametrize("backend", IMAGE_BACKENDS[:1])
async def test_an_image_link_where_corral_mounts_is_refused(backend: str, tmp_path: Path) -> None:
    from corral.errors import ImageError

    root = busybox_root(tmp_path / "root")
    (root / "workspace").symlink_to("/etc")
    with pytest.raises(ImageError, match="/workspace passes through a symbolic link"):
        async with Sandbox(backend_policy(backend, image=str(root))):
            pass
    policy = backend_policy(backend, image=str(root), filesystem={"root_size": None})
    with pytest.raises(ImageError, match="/workspace passes through a symbolic link"):
        async with Sandbox(policy):
            pass
    assert not (Path("/etc") / "workspace").exists()


@pytest.mark.parametrize("backend", ["oci-runsc"])
async def test_backends_without_images_refuse_naming_the_field(
    backend: str, tmp_path: Path
) -> None:
    if backend_skip(backend):
        pytest.skip(str(backend_skip(backend)))
    root = busybox_root(tmp_path / "root")
    with pytest.raises(BackendUnavailable, match=r"policy\.image") as caught:
        async with Sandbox(backend_policy(backend, image=str(root))):
            pass
    assert "bwrap" in caught.value.message  # the way out
    with pytest.raises(BackendUnavailable, match=r"policy\.user"):
        async with Sandbox(backend_policy(backend, user="root")):
            pass


@pytest.mark.parametrize("backend", IMAGE_BACKENDS[1:])
async def test_pause_snapshot_and_fork_on_oci(
    backend: str, layout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's cgroup freezes the box for a snapshot; forks start from it on the same
    backend and diverge."""
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    policy = backend_policy(backend, image=str(layout), user="root")
    async with Sandbox(policy) as sb:
        await sb.run("mkdir -p /data && echo base > /data/f")
        await sb.pause()
        await sb.resume()
        forks = await sb.fork(2)
        seen = []
        for i, fork in enumerate(forks):
            async with fork:
                await fork.run(f"echo fork{i} >> /data/f")
                seen.append((await fork.run("cat /data/f")).stdout.split())
                assert (await fork.info())["backend"] == "oci"
        assert seen == [["base", "fork0"], ["base", "fork1"]], seen
        assert (await sb.run("cat /data/f")).stdout == "base\n"
