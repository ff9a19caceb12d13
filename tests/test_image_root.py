"""Boxes on an image's root (``policy.image``) on the bwrap backend: a busybox root with no
Python, read-only, the workspace shared as usual, the agent run by the host's interpreter
from a hidden path the box user cannot reach; other backends refuse naming the field."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.backends import landlock

pytestmark = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="images run on the bwrap backend as root"),
]

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "id", "echo", "touch", "mkdir", "rm", "ln", "readlink", "which")


@pytest.fixture(scope="module")
def busybox_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with busybox-static alone (no Python, no libc), as an image would be."""
    if not os.path.exists(BUSYBOX):
        pytest.skip("busybox-static is not installed")
    root = tmp_path_factory.mktemp("image") / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text("NAME=corral-test-image\n")
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")  # no /etc/group
    (root / "usr").symlink_to("/nonexistent-host-usr")  # an absolute link: never followed
    os.chmod(root, 0o755)
    return root


def tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_size) for p in root.rglob("*")
    )


async def test_a_command_runs_in_an_image_without_python(
    busybox_root: Path, tmp_path: Path
) -> None:
    before = tree(busybox_root)
    read_only = Policy(image=str(busybox_root), filesystem={"root_size": None})
    async with Sandbox(read_only, workspace=tmp_path) as sb:
        r = await sb.run("cat /etc/os-release; id -u; command -v python3 || echo no-python")
        assert r.stdout.splitlines() == ["NAME=corral-test-image", "1000", "no-python"], r
        assert (await sb.run("id -un")).stdout == "user\n"  # the box's passwd over the image's
        listing = (await sb.run("ls /")).stdout.split()
        assert "workspace" in listing and "boot" not in listing  # no host top-level entry
        w = await sb.run("echo hi > out.txt && cat /workspace/out.txt")
        assert w.stdout == "hi\n" and (tmp_path / "out.txt").read_text() == "hi\n"
        ro = await sb.run("touch /etc/new 2>&1; touch /bin/new 2>&1; echo $?")
        assert "Read-only file system" in ro.stdout, ro
        info = await sb.info()
        if landlock.host_abi()[0] >= 1:  # Landlock holds on an image root too
            assert info["landlock"]["enforced"] is True, info["landlock"]
    assert tree(busybox_root) == before  # the image is unchanged on the host


async def test_the_hidden_interpreter_is_out_of_the_box_users_reach(busybox_root: Path) -> None:
    async with Sandbox(Policy(image=str(busybox_root))) as sb:
        r = await sb.run(
            "ls /run/corral 2>&1; /run/corral/host/usr/bin/python3.11 -c 1 2>&1; echo $?"
        )
        assert "Permission denied" in r.stdout and r.stdout.strip().endswith("126"), r
        assert (await sb.run("readlink /usr")).stdout == "/nonexistent-host-usr\n"


def test_corral_run_image(busybox_root: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "corral.cli", "run", "--image", str(busybox_root)]
    r = subprocess.run(
        [*argv, "--workspace", str(tmp_path), "--", "cat", "/etc/os-release"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout == "NAME=corral-test-image\n", r
    bad = subprocess.run(
        [*argv[:-1], str(tmp_path / "missing"), "--workspace", str(tmp_path), "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 125 and "image_not_found" in bad.stderr and "Traceback" not in bad.stderr
    )


async def test_an_oci_layout_runs_with_its_env_under_the_policys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OCI image layout is unpacked into the store and run; its config's ``Env`` goes
    over the box's defaults, the policy's ``env`` over it."""
    from oci_images import busybox_root, dir_tar, write_layout

    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = busybox_root(tmp_path / "root")
    config: dict[str, object] = {"Env": ["PATH=/bin", "GREETING=from-image", "MODE=image"]}
    layout = write_layout(tmp_path / "layout", [dir_tar(root)], config=config).path
    policy = Policy(image=str(layout), env={"MODE": "policy"})
    async with Sandbox(policy) as sb:
        r = await sb.run('cat /etc/hello; echo "$GREETING $MODE $PATH"')
        assert r.stdout == "hello from the image\nfrom-image policy /bin\n", r


async def test_the_image_staging_directory_is_closed_to_other_users(busybox_root: Path) -> None:
    from corral.backends.host.state import state_root

    async with Sandbox(Policy(image=str(busybox_root))) as sb:
        entry = state_root() / "mnt" / f"{sb.sandbox_id}.image"
        st = entry.stat()
        assert st.st_mode & 0o777 == 0o700 and st.st_uid != 0, oct(st.st_mode)
        assert (await sb.run("cat /etc/os-release")).stdout == "NAME=corral-test-image\n"
    assert not entry.exists()  # released with the box


async def test_a_warm_pool_keeps_boxes_on_an_image(busybox_root: Path, tmp_path: Path) -> None:
    """Pools are keyed by policy, and so by image: its one-shots run on the image's root,
    writable roots fresh for each."""
    from corral import SandboxPool

    before = tree(busybox_root)
    async with SandboxPool(Policy(image=str(busybox_root), user="root"), size=1) as pool:
        for _ in range(2):
            r = await pool.run(
                "cat /etc/os-release; ls /etc; echo made > /etc/made", workspace=tmp_path
            )
            assert r.exit_code == 0, r.stderr
            assert "NAME=corral-test-image" in r.stdout
            assert "made" not in r.stdout  # the last one-shot's change is gone
    assert tree(busybox_root) == before
