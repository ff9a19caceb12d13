"""The files API's host I/O (issue 14): a large read or write in the workspace moves its
bytes through a host fd (corral.backends.host.hostfiles), often as root. A box controls every
path in its workspace: it plants links to host files, FIFOs, swaps a file for a link while
the host works. Each attack asserts the host read or wrote nothing outside the workspace
(``host_guard`` checks the canary) and never blocked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.backends.host import hostfiles
from corral.errors import SandboxError
from security.conftest import Canary

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

BOUND = 15  # seconds: a refusal is immediate; only a blocked open of a FIFO reaches this


def _inode(path: Path) -> hostfiles.Inode:
    st = os.stat(path)
    return st.st_dev, st.st_ino


async def _plant(sb: Sandbox, script: str) -> None:
    r = await sb.run(["sh", "-c", script])
    assert r.exit_code == 0, r.stderr


async def test_host_io_follows_no_link_planted_in_the_workspace(
    box_policy: Policy, workspace: Path, canary: Canary
) -> None:
    """A link to a host file, and a linked directory, even given the very inode of the host
    file (the best a racing box could arrange): no byte read from it, none written to it."""
    async with Sandbox(box_policy, workspace=workspace) as sb:
        await _plant(sb, f"ln -s {canary.file} file.bin && ln -s {canary.dir} dir")
    target = _inode(canary.file)
    for rel in ("file.bin", f"dir/{canary.file.name}"):
        got = await asyncio.to_thread(hostfiles.read_same, str(workspace), rel, target, 1 << 20)
        assert got is None
        wrote = await asyncio.to_thread(
            hostfiles.append_same, str(workspace), rel, target, memoryview(b"box-chosen")
        )
        assert wrote is None
    assert canary.file.read_text() == canary.content


async def test_host_io_never_blocks_on_a_fifo(box_policy: Policy, workspace: Path) -> None:
    if box_policy.backend == "microvm":
        pytest.skip("a microVM's 9p workspace makes no fifo (ENXIO) for the host to meet")
    async with Sandbox(box_policy, workspace=workspace) as sb:
        await _plant(sb, "mkfifo pipe.bin")
    fifo = _inode(workspace / "pipe.bin")
    ws = str(workspace)
    read = asyncio.to_thread(hostfiles.read_same, ws, "pipe.bin", fifo, 1 << 20)
    assert await asyncio.wait_for(read, BOUND) is None
    write = asyncio.to_thread(hostfiles.append_same, ws, "pipe.bin", fifo, memoryview(b"x"))
    assert await asyncio.wait_for(write, BOUND) is None


async def test_host_io_refuses_another_file_than_the_agents(workspace: Path) -> None:
    """The file was swapped after the agent opened it: the host touches neither."""
    (workspace / "a.bin").write_bytes(b"agent's")
    (workspace / "b.bin").write_bytes(b"other")
    agents = _inode(workspace / "a.bin")
    os.replace(workspace / "b.bin", workspace / "a.bin")
    ws = str(workspace)
    assert await asyncio.to_thread(hostfiles.read_same, ws, "a.bin", agents, 100) is None
    wrote = await asyncio.to_thread(hostfiles.append_same, ws, "a.bin", agents, memoryview(b"x"))
    assert wrote is None
    assert (workspace / "a.bin").read_bytes() == b"other"


async def test_a_box_swapping_a_file_for_a_link_during_large_io(
    box_policy: Policy, workspace: Path, canary: Canary
) -> None:
    """While the host writes and reads a large file, the box swaps it, again and again, for a
    link to a host file. Each call succeeds or is refused; none returns the host file's bytes,
    and the host file is unchanged (host_guard)."""
    blob = b"\xa5" * (3 << 20)
    async with Sandbox(box_policy, workspace=workspace) as sb:
        swapper = await sb.spawn(
            [
                "sh",
                "-c",
                f"ln -s {canary.file} link; i=0; while [ $i -lt 20000 ]; do "
                "cp -P link t.bin.new 2>/dev/null; mv -f t.bin.new t.bin; "
                ": > plain.new; mv -f plain.new t.bin; i=$((i+1)); done",
            ]
        )
        outcomes = {"ok": 0, "refused": 0}
        try:
            for _ in range(30):
                for op in ("write", "read"):
                    sb.files._host_ok = True  # a refusal turns host I/O off: attack it each time
                    try:
                        if op == "write":
                            await sb.files.write("t.bin", blob)
                        else:
                            data = await sb.files.read("t.bin", max_bytes=8 << 20)
                            assert canary.content.encode() not in data
                        outcomes["ok"] += 1
                    except SandboxError:
                        outcomes["refused"] += 1
        finally:
            await swapper.terminate()
        assert sum(outcomes.values()) == 60
    assert canary.file.read_text() == canary.content


async def test_a_masked_file_is_not_read_through_the_host(tmp_path: Path) -> None:
    """A path masked by its host name (deny_read of the workspace's own .ssh, spelled as a
    host path) passes the lexical check; the box's mask stops the agent, so the host never
    opens the file."""
    ws = tmp_path / "ws"
    (ws / ".ssh").mkdir(parents=True)
    secret = b"PRIVATE KEY " * (300 << 10)  # past the host I/O threshold
    (ws / ".ssh" / "id").write_bytes(secret)
    policy = Policy.from_dict({"filesystem": {"deny_read": [str(ws / ".ssh")]}})
    async with Sandbox(policy, workspace=ws) as sb:
        with pytest.raises(SandboxError):
            await sb.files.read(".ssh/id", max_bytes=8 << 20)
        with pytest.raises(SandboxError):
            await sb.files.write(".ssh/id", b"x" * (3 << 20))
    assert (ws / ".ssh" / "id").read_bytes() == secret
