"""sandbox.files in a real box."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from corral import FileNotFound, FileTooLarge, Sandbox
from corral.errors import (
    ErrorCode,
    FileOpError,
    PathOutsideSandbox,
    SandboxError,
)

pytestmark = pytest.mark.needs_bwrap


async def test_write_read_list_exists_remove(sandbox: Sandbox, workspace: Path) -> None:
    size = await sandbox.files.write("dir/sub/a.txt", "hello")
    assert size == 5
    assert await sandbox.files.read("dir/sub/a.txt") == b"hello"
    assert await sandbox.files.read("/workspace/dir/sub/a.txt") == b"hello"
    await sandbox.files.write("dir/sub/a.txt", " world", append=True)
    assert (workspace / "dir/sub/a.txt").read_text() == "hello world"
    entries = await sandbox.files.list("dir")
    assert [(e.name, e.type, e.path) for e in entries] == [("sub", "dir", "/workspace/dir/sub")]
    assert await sandbox.files.exists("dir/sub/a.txt")
    assert not await sandbox.files.exists("dir/missing")
    info = await sandbox.files.stat("dir/sub/a.txt")
    assert info is not None and info.size == 11 and info.type == "file"
    await sandbox.files.remove("dir/sub/a.txt")
    assert not (workspace / "dir/sub/a.txt").exists()
    with pytest.raises(FileOpError):
        await sandbox.files.remove("dir")  # not empty
    await sandbox.files.remove("dir", recursive=True)
    assert not (workspace / "dir").exists()


async def test_binary_and_large_files_roundtrip(sandbox: Sandbox) -> None:
    blob = await asyncio.to_thread(os.urandom, 20 << 20)  # not on the loop under test
    await sandbox.files.write("blob.bin", blob)
    assert await sandbox.files.read("blob.bin", max_bytes=32 << 20) == blob
    r = await sandbox.run("wc -c < blob.bin")
    assert r.stdout.strip() == str(20 << 20)


@pytest.mark.parametrize("size", [0, 1, (256 << 10) - 1, 256 << 10, (8 << 20) + 1, 17 << 20])
async def test_reads_of_every_size_are_byte_exact(sandbox: Sandbox, size: int) -> None:
    """Around the agent's sendfile threshold (256 KiB), one request (8 MiB) and the byte
    past it, and past one frame's most (16 MiB); ranges too."""
    blob = await asyncio.to_thread(os.urandom, size)
    await sandbox.files.write("f.bin", blob)
    assert await sandbox.files.read("f.bin", max_bytes=size) == blob
    if size:
        with pytest.raises(FileTooLarge):
            await sandbox.files.read("f.bin", max_bytes=size - 1)
        mid = size // 3
        assert await sandbox.files.read("f.bin", offset=mid, length=size) == blob[mid:]
    assert await sandbox.files.read("f.bin", offset=size + 5, length=10) == b""


async def test_reads_stay_in_order_with_output_and_each_other(sandbox: Sandbox) -> None:
    """Large reads in flight together (one by sendfile, the others read while it goes) while
    a command prints: every frame arrives whole and in order."""
    blobs = [await asyncio.to_thread(os.urandom, (3 << 20) + n) for n in range(4)]
    for n, blob in enumerate(blobs):
        await sandbox.files.write(f"b{n}.bin", blob)
    talker = await sandbox.spawn(["sh", "-c", "for i in $(seq 2000); do echo line $i; done"])
    got = await asyncio.gather(
        *(sandbox.files.read(f"b{n}.bin", max_bytes=8 << 20) for n in range(4))
    )
    assert got == blobs
    assert (await talker.wait(timeout=60)).exit_code == 0
    assert talker.output().splitlines()[-1] == "line 2000"


async def test_read_over_the_cap_is_file_too_large(sandbox: Sandbox) -> None:
    await sandbox.files.write("f", b"x" * 1000)
    with pytest.raises(FileTooLarge) as info:
        await sandbox.files.read("f", max_bytes=100)
    assert info.value.code == ErrorCode.FILE_TOO_LARGE


async def test_missing_file_is_file_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(FileNotFound) as info:
        await sandbox.files.read("nope.txt")
    assert info.value.code == ErrorCode.FILE_NOT_FOUND
    assert "nope.txt" in info.value.message


async def test_tmp_is_private_and_usable(sandbox: Sandbox) -> None:
    await sandbox.files.write("/tmp/scratch", "t")
    assert (await sandbox.run("cat /tmp/scratch")).stdout == "t"
    assert not os.path.exists("/tmp/scratch")


async def test_files_written_by_the_tool_are_the_command_users(sandbox: Sandbox) -> None:
    await sandbox.files.write("mine.txt", "x")
    r = await sandbox.run("stat -c %u mine.txt && echo more >> mine.txt && cat mine.txt")
    assert r.stdout.split() == ["1000", "xmore"]


async def test_removing_the_workspace_root_is_refused(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxError) as info:
        await sandbox.files.remove(".", recursive=True)
    assert info.value.code == ErrorCode.INVALID_INPUT


async def test_the_files_api_reads_what_a_command_can_read(tmp_path: Path) -> None:
    async with Sandbox(workspace=tmp_path) as sb:
        seen = await sb.run("cat /etc/hostname")
        assert seen.exit_code == 0
        assert await sb.files.read_text("/etc/hostname") == seen.stdout
        info = await sb.files.stat("/etc/hostname")
        assert info is not None and info.type == "file"
        for kernel in ("/proc/self/environ", "/proc/self/mem", "/dev/fd/0", "/sys/kernel"):
            with pytest.raises(PathOutsideSandbox, match="kernel interface"):
                await sb.files.read(kernel)
        with pytest.raises(PathOutsideSandbox):
            await sb.files.write("/etc/hostname", "x")
