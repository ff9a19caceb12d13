"""Landlock as the second layer: a host directory mounted read-write by mistake (the mount is
there, the layout's rules do not name it) stays out of reach, whatever path, descriptor or
new Landlock domain the box tries. Runs where the kernel has Landlock ABI 2+ (bwrap, runc,
crun; gVisor's kernel has none, and a microVM applies none)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.errors import SandboxError
from security.helpers import box_py
from test_landlock import STRAY, needs_landlock, stray, with_stray

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap, needs_landlock]
__all__ = ["stray"]  # the fixture, used by name


@pytest.fixture
async def box(box_policy: Policy, workspace: Path, stray: Path) -> AsyncIterator[Sandbox]:
    if box_policy.runtime == "runsc":
        pytest.skip("gVisor's kernel has no Landlock")
    if box_policy.backend == "microvm":
        pytest.skip("a microVM applies no Landlock: the guest's kernel and the VM are the boundary")
    async with Sandbox(with_stray(box_policy, stray), workspace=workspace) as sb:
        yield sb


async def test_stray_mount_open_write_create(box: Sandbox, stray: Path) -> None:
    res = await box_py(
        box,
        f"res = [err(lambda: open('{STRAY}/secret').read()),"
        f" err(lambda: open('{STRAY}/secret', 'a')),"
        f" err(lambda: open('{STRAY}/new', 'w')),"
        f" err(os.mkdir, '{STRAY}/d'), err(os.unlink, '{STRAY}/secret'),"
        f" err(os.symlink, '/etc/passwd', '{STRAY}/l'), err(os.mkfifo, '{STRAY}/f')]",
    )
    assert res == ["EACCES"] * 7
    assert sorted(p.name for p in stray.iterdir()) == ["secret", "tool"]
    assert (stray / "secret").read_text() == "host data\n"


async def test_stray_mount_through_a_directory_fd(box: Sandbox) -> None:
    """Listing / is allowed (names only), so the directory opens: what is beneath it does
    not, relative to that descriptor either."""
    res = await box_py(
        box,
        f"d = os.open('{STRAY}', os.O_RDONLY | os.O_DIRECTORY)\n"
        "res = [err(lambda: os.open('secret', os.O_RDONLY, dir_fd=d)),"
        " err(lambda: os.open('new', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d))]",
    )
    assert res == ["EACCES", "EACCES"]


async def test_stray_mount_through_links_and_proc(box: Sandbox) -> None:
    res = await box_py(
        box,
        f"os.symlink('{STRAY}/secret', '/workspace/link')\n"
        "res = [err(lambda: open('/workspace/link').read()),"
        f" err(lambda: open('/proc/self/root{STRAY}/secret', 'a')),"
        f" err(lambda: open('/proc/1/root{STRAY}/secret').read())]",
    )
    assert res[:2] == ["EACCES", "EACCES"]
    assert res[2] in ("EACCES", "EPERM")  # not even reachable as a path of pid 1


async def test_stray_mount_exec(box: Sandbox) -> None:
    r = await box.run([f"{STRAY}/tool"])
    assert r.exit_code == 126 and "permission denied" in r.stderr.lower()


async def test_a_new_domain_cannot_widen_the_rules(box: Sandbox) -> None:
    """A command stacks its own ruleset granting /stray everything: domains only narrow."""
    code = f"""
def u64(v):
    return v.to_bytes(8, sys.byteorder)
rs = sc(444, u64((1 << 16) - 1), 8, 0)["ret"]
fd = os.open('{STRAY}', os.O_PATH)
add = sc(445, rs, 1, u64((1 << 16) - 1) + fd.to_bytes(4, sys.byteorder), 0)
full = sc(445, rs, 1, u64((1 << 16) - 1) + os.open('/', os.O_PATH).to_bytes(4, sys.byteorder), 0)
me = sc(446, rs, 0)
res = [add["errno"], me["errno"], err(lambda: open('{STRAY}/new', 'w'))]
"""
    assert await box_py(box, code) == [None, None, "EACCES"]


async def test_the_file_tools_are_inside_the_rules(box: Sandbox, stray: Path) -> None:
    with pytest.raises(SandboxError):
        await box.files.write(f"{STRAY}/new", b"x")
    with pytest.raises(SandboxError):
        await box.files.read(f"{STRAY}/secret")
    assert not (stray / "new").exists()
