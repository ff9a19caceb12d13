"""Limits nobody chose: large stdin streams to the command in chunks, a command line as long
as the kernel takes reaches it, and what is beyond is a SandboxError with a stable code."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from corral import RequestTooLarge, Sandbox, SpawnFailed
from corral.errors import ErrorCode


async def test_fifty_mib_of_stdin(tmp_path: Path) -> None:
    data = bytes(range(256)) * (50 * 4096)  # 50 MiB
    async with Sandbox(workspace=tmp_path) as sb:
        r = await sb.run("sha256sum", stdin=data, timeout=120)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
        # A command that stops reading early ends the upload like a broken pipe.
        early = await sb.run("head -c 5", stdin=data, timeout=120)
        assert (early.exit_code, early.stdout) == (0, "\x00\x01\x02\x03\x04")
        assert (await sb.run("echo still here")).stdout == "still here\n"


async def test_a_one_mib_command_line_and_beyond(tmp_path: Path) -> None:
    args = ["a" * 1023] * 1024  # 1 MiB of arguments (each below the kernel's 128 KiB)
    async with Sandbox(workspace=tmp_path) as sb:
        r = await sb.run(["sh", "-c", 'echo "$#"', "sh", *args])
        assert (r.exit_code, r.stdout) == (0, "1024\n"), r.stderr
        with pytest.raises(SpawnFailed, match=r"(?i)argument list too long"):
            await sb.run(["true", *(["a" * 4095] * 2048)])  # 8 MiB: beyond ARG_MAX
        with pytest.raises(RequestTooLarge) as info:
            await sb.run(["true", *(["a" * 65535] * 300)])  # 19 MiB: beyond one message
        assert info.value.code is ErrorCode.REQUEST_TOO_LARGE
        assert (await sb.run("echo ok")).stdout == "ok\n"
