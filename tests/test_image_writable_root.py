"""A writable root on an image (bwrap): the image idmapped read-only below, a per-box tmpfs
of ``filesystem.root_size`` above. Box root changes the image's files, the box user writes
only what the image gives uid 1000; the image on the host never changes, a second box
starts from the image again, the cap holds, and nothing of the upper outlives the box."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from corral import Policy, PolicyError, Sandbox
from corral.backends.host.state import state_root

pytestmark = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="images run on the bwrap backend as root"),
]

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "id", "echo", "touch", "mkdir", "rm", "ln", "dd", "mknod", "stat")


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A busybox root as the store keeps one: root's files host uid 0's, one directory the
    image's uid 1000 owns."""
    if not os.path.exists(BUSYBOX):
        pytest.skip("busybox-static is not installed")
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "motd").write_text("from the image\n")
    (root / "srv" / "app").mkdir(parents=True)
    os.chown(root / "srv" / "app", 1000, 1000)
    os.chmod(root, 0o755)
    return root


def _own_entries() -> list[Path]:
    """Staging entries of this process's boxes (other sessions may run boxes meanwhile)."""
    import json

    mine = []
    for entry in (state_root() / "mnt").glob("*"):
        try:
            owner = json.loads((entry / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host_pid") == os.getpid():
            mine.append(entry)
    return mine


def snapshot(root: Path) -> list[tuple[str, int, int, int, bytes]]:
    out = []
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        out.append((str(p.relative_to(root)), st.st_mode, st.st_uid, st.st_size, data[:64]))
    return out


async def test_box_root_changes_the_image_root_and_the_host_image_stays(
    image: Path, tmp_path: Path
) -> None:
    before = snapshot(image)
    policy = Policy(image=str(image), user="root")
    async with Sandbox(policy, workspace=tmp_path) as sb:
        r = await sb.run(
            "echo changed > /etc/motd && echo new > /etc/new && rm /bin/dd && "
            "mkdir -p /srv/more && cat /etc/motd /etc/new; ls /bin/dd 2>&1; stat -c %u /etc",
            cwd="/",
        )
        assert r.stdout.splitlines()[:2] == ["changed", "new"], r
        assert "No such file" in r.stdout and r.stdout.endswith("0\n"), r  # root's, as on disk
    assert snapshot(image) == before  # the image on the host is unchanged
    async with Sandbox(policy, workspace=tmp_path) as sb:  # a fresh copy for the next box
        r = await sb.run("cat /etc/motd; ls /etc/new 2>&1; ls /bin/dd", cwd="/")
        assert r.stdout.splitlines()[0] == "from the image", r
        assert "No such file" in r.stdout and "/bin/dd" in r.stdout


async def test_the_box_user_writes_only_what_the_image_gives_uid_1000(
    image: Path, tmp_path: Path
) -> None:
    async with Sandbox(Policy(image=str(image)), workspace=tmp_path) as sb:
        r = await sb.run("touch /etc/x 2>&1; echo $?; touch /srv/app/mine && stat -c %u /srv/app")
        assert "Permission denied" in r.stdout and r.stdout.endswith("1000\n"), r
        assert not (image / "srv" / "app" / "mine").exists()


async def test_the_root_size_caps_what_the_box_writes(image: Path, tmp_path: Path) -> None:
    policy = Policy(image=str(image), user="root", filesystem={"root_size": "2M"})
    async with Sandbox(policy, workspace=tmp_path) as sb:
        r = await sb.run("dd if=/dev/zero of=/etc/big bs=1M count=8 2>&1; echo $?", cwd="/")
        # ENOSPC on a tmpfs upper, EDQUOT (the qgroup) on the copy-on-write store's
        full = ("No space left on device", "Disk quota exceeded")
        assert any(f in r.stdout for f in full) and r.stdout.endswith("1\n"), r
        r = await sb.run("busybox du -k /etc/big", cwd="/")
        assert int(r.stdout.split()[0]) <= 2048, r


def test_the_root_size_is_checked_by_the_policy() -> None:
    with pytest.raises(PolicyError, match=r"filesystem\.root_size"):
        Policy(filesystem={"root_size": "4K"})
    with pytest.raises(PolicyError, match=r"filesystem\.root_size"):
        Policy(filesystem={"root_size": "lots"})


async def test_the_upper_is_out_of_reach_and_gone_with_the_box(image: Path, tmp_path: Path) -> None:
    """What a box leaves above the image (a link to a host file, a FIFO, a setuid file)
    stays in its tmpfs; the lower and upper mounts are host root's, closed to other users,
    not in the box; the image stays unchanged and every staging entry is gone at the end."""
    before = snapshot(image)
    policy = Policy(image=str(image), user="root")
    async with Sandbox(policy, workspace=tmp_path) as sb:
        mnt = state_root() / "mnt"
        for part, owner_is_root in (("lower", True), ("upper", True), ("image", False)):
            st = (mnt / f"{sb.sandbox_id}.{part}").stat()
            assert st.st_mode & 0o777 == 0o700 and (st.st_uid == 0) == owner_is_root, part
        r = await sb.run(
            "ln -s /etc/shadow /etc/link; mkfifo /etc/fifo 2>/dev/null; "
            "cp /bin/busybox /bin/suid && chmod 4755 /bin/suid; "
            "mknod /etc/dev c 1 3 2>&1; echo mknod=$?; "
            f"ls {mnt} 2>&1; mount -o remount,rw /etc 2>&1; echo remount=$?; "
            "umount /etc 2>&1; echo umount=$?",
            cwd="/",
        )
        assert "mknod=1" in r.stdout and "remount=1" in r.stdout and "umount=1" in r.stdout, r
        assert "No such file" in r.stdout, r  # the host's staging mounts are not in the box
    assert snapshot(image) == before
    assert not list((state_root() / "mnt").glob(f"{sb.sandbox_id}.*"))
    assert not _own_entries()


async def test_box_root_installs_a_package_and_the_host_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's check: a package installed as box root on an image from the store; the
    image, the store and the host's own package database are unchanged."""
    from oci_images import DPKG_TOOLS, dir_tar, dpkg_root, make_deb, write_layout

    if not all(os.path.exists(t) for t in DPKG_TOOLS):
        pytest.skip("dpkg is not installed")
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = dpkg_root(tmp_path / "rootfs")
    layout = write_layout(tmp_path / "layout", [dir_tar(root)], config={"Env": []}).path
    deb = make_deb(tmp_path / "ws")
    policy = Policy(image=str(layout), user="root")
    async with Sandbox(policy, workspace=deb.parent) as sb:
        store_before = snapshot(tmp_path / "store")
        r = await sb.run(
            "dpkg -i corral-hello.deb && corral-hello && "
            "cat /var/lib/dpkg/status /var/lib/dpkg/updates/* 2>/dev/null | grep -A9 corral-h "
            "| grep Status"
        )
        assert r.exit_code == 0, (r.stdout, r.stderr)
        assert r.stdout.endswith("hello from a package\nStatus: install ok installed\n"), r
    assert snapshot(tmp_path / "store") == store_before
    assert not Path("/usr/bin/corral-hello").exists()
    host = await _host_dpkg_status("corral-hello")
    assert "not installed" in host or "no information" in host
    async with Sandbox(Policy(image=str(layout)), workspace=deb.parent) as sb:
        r = await sb.run("dpkg -i corral-hello.deb 2>&1; echo $?; ls /usr/bin/corral-hello 2>&1")
        *_, status, listing = r.stdout.splitlines()
        assert status != "0" and "No such file" in listing, r  # the box user cannot


async def _host_dpkg_status(name: str) -> str:
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        "dpkg", "-s", name, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return out.decode()


async def test_export_root_is_what_the_box_changed_with_its_own_ids(
    image: Path, tmp_path: Path
) -> None:
    """``Sandbox.export_root``: the upper as an OCI layer (a deletion as a whiteout, a new
    top-level directory), owners as the box sees them, the box's mount points left out."""
    import tarfile

    policy = Policy(image=str(image), user="root")
    (tmp_path / "ws").mkdir()
    async with Sandbox(policy, workspace=tmp_path / "ws") as sb:
        assert await sb.export_root(tmp_path / "empty.tar") == 0  # nothing changed yet
        r = await sb.run(
            "echo x > /etc/new && rm /etc/motd && mkdir /data && chown 1000:1000 /data", cwd="/"
        )
        assert r.exit_code == 0, r
        count = await sb.export_root(tmp_path / "layer.tar")
    with tarfile.open(tmp_path / "layer.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["data", "etc", "etc/.wh.motd", "etc/new"] and count == 4
    assert (members["etc/new"].uid, members["data"].uid, members["data"].gid) == (0, 1000, 1000)
    async with Sandbox(Policy(image=str(image), filesystem={"root_size": None})) as sb:
        with pytest.raises(Exception, match="no writable root"):
            await sb.export_root(tmp_path / "none.tar")
        info = await sb.info()
        assert info["user"] == "user" and info["image"]["writable"] is False, info
    async with Sandbox(policy, workspace=tmp_path / "ws") as sb:
        info = await sb.info()
        assert info["user"] == "root" and info["image"]["writable"] is True, info


@pytest.mark.parametrize("writable", [True, False])
@pytest.mark.parametrize(("link", "target"), [("tmp", "/etc"), ("workspace", "/usr")])
async def test_an_image_link_where_corral_mounts_is_refused(
    image: Path, tmp_path: Path, writable: bool, link: str, target: str
) -> None:
    """bwrap resolves mount destinations before it enters the box's root: an image's
    ``/tmp -> /etc`` would send the box's /tmp, or the directories bwrap makes for it, to
    the host's. The host looks each destination up beneath the image following no link."""
    from corral.errors import ImageError

    (image / link).symlink_to(target)
    size = "64M" if writable else None
    policy = Policy(image=str(image), filesystem={"root_size": size})
    if not writable and link == "tmp":  # a read-only root leaves the image's /tmp out
        async with Sandbox(policy, workspace=tmp_path) as sb:
            r = await sb.run("echo x > /tmp/t && cat /tmp/t && ls -d /etc/t 2>&1")
            assert r.stdout.startswith("x\n") and "No such file" in r.stdout, r
        return
    with pytest.raises(ImageError, match=f"/{link} passes through a symbolic link"):
        async with Sandbox(policy, workspace=tmp_path):
            pass
    assert not _own_entries()  # released


async def test_export_root_never_writes_where_the_box_can_plant_a_link(
    image: Path, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("host file\n")
    async with Sandbox(Policy(image=str(image), user="root"), workspace=ws) as sb:
        await sb.run("ln -s /etc/x /workspace/layer.tar")
        (ws / "planted").symlink_to(victim)
        with pytest.raises(PolicyError, match="which the box can write"):
            await sb.export_root(ws / "planted")
        (tmp_path / "link.tar").symlink_to(victim)
        with pytest.raises(OSError, match="symbolic links"):
            await sb.export_root(tmp_path / "link.tar")  # a link as the last component
    assert victim.read_text() == "host file\n"


async def test_export_root_leaves_out_the_boxs_mount_points_at_any_depth(
    image: Path, tmp_path: Path
) -> None:
    """A share at ``/srv/app/in`` (the image lacks it: bwrap makes the mount point in the
    overlay) is a mount point, not a change; what the box wrote beside it is."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "ws").mkdir()
    policy = Policy(
        image=str(image),
        user="root",
        filesystem={"mounts": [{"host": str(shared), "guest": "/srv/app/in"}]},
    )
    async with Sandbox(policy, workspace=tmp_path / "ws") as sb:
        assert (await sb.run("echo mine > /srv/app/beside", cwd="/")).exit_code == 0
        await sb.export_root(tmp_path / "layer.tar")
    import tarfile

    with tarfile.open(tmp_path / "layer.tar") as tar:
        names = sorted(tar.getnames())
    assert names == ["srv", "srv/app", "srv/app/beside"], names


async def test_the_root_caps_inodes_too(image: Path, tmp_path: Path) -> None:
    """Empty files cost no bytes: the writable root's tmpfs caps inodes as well (one per
    2 KiB of root_size, at least 8192); on the copy-on-write store their metadata counts
    against root_size."""
    from corral.backends.host.overlay import root_inodes

    assert root_inodes(1 << 20) == 8192 and root_inodes(1 << 30) == 524288
    (tmp_path / "ws").mkdir()
    policy = Policy(image=str(image), user="root", filesystem={"root_size": "1M"})
    async with Sandbox(policy, workspace=tmp_path / "ws") as sb:
        r = await sb.run(
            "mkdir /many && cd /many && busybox seq 9000 | busybox xargs touch 2>&1 | "
            "busybox tail -1; ls | busybox wc -l",
            cwd="/",
        )
        # tmpfs: out of inodes (ENOSPC); the copy-on-write store: metadata counts in the
        # subvolume's qgroup (EDQUOT)
        assert "No space left on device" in r.stdout or "Disk quota exceeded" in r.stdout, r
        assert int(r.stdout.split()[-1]) < 8192, r
