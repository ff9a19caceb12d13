"""A command that cannot start: ``run`` gives a result as a shell would (127 not found, 126
not executable, the reason on stderr), ``spawn`` raises a SpawnFailed subclass with its own
code; file operations tell a directory from other failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import (
    CommandFailed,
    CommandNotFound,
    IsADirectory,
    NotADirectory,
    NotExecutable,
    Sandbox,
    SpawnFailed,
)
from corral.errors import ErrorCode


async def test_not_found_and_not_executable(tmp_path: Path) -> None:
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "script.sh").chmod(0o644)
    (tmp_path / "adir").mkdir()
    async with Sandbox(workspace=tmp_path) as sb:
        r = await sb.run(["/no/such/prog"])
        assert (r.exit_code, r.ended, r.stdout) == (127, "not_started", "")
        assert "/no/such/prog: no such file" in r.stderr
        assert "PATH" not in r.stderr  # an absolute path is not looked up on PATH
        r = await sb.run(["nosuchprog"])
        assert r.exit_code == 127
        assert "nosuchprog: command not found (PATH=" in r.stderr
        r = await sb.run(["./script.sh"])
        assert (r.exit_code, r.ended) == (126, "not_started")
        assert "not executable" in r.stderr
        r = await sb.run(["./adir"])
        assert r.exit_code == 126
        assert "is a directory" in r.stderr
        # The working directory named as the program: the program is at fault, not the cwd.
        r = await sb.run(["/workspace", "x"])
        assert (r.exit_code, r.ended) == (126, "not_started"), r
        assert "/workspace: not executable (is a directory)" in r.stderr
        with pytest.raises(CommandFailed) as failed:
            await sb.run(["nosuchprog"], check=True)
        assert failed.value.result.exit_code == 127  # type: ignore[attr-defined]
        with pytest.raises(CommandNotFound) as nf:
            await sb.spawn(["nosuchprog"])
        assert nf.value.code is ErrorCode.COMMAND_NOT_FOUND
        assert isinstance(nf.value, SpawnFailed)
        with pytest.raises(NotExecutable) as ne:
            await sb.spawn(["./script.sh"])
        assert ne.value.code is ErrorCode.NOT_EXECUTABLE
        with pytest.raises(SpawnFailed) as cwd:
            await sb.spawn(["true"], cwd="missing")
        assert cwd.value.code is ErrorCode.SPAWN_FAILED


async def test_is_a_directory_and_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    async with Sandbox(workspace=tmp_path) as sb:
        with pytest.raises(IsADirectory) as info:
            await sb.files.read("adir")
        assert info.value.code is ErrorCode.IS_A_DIRECTORY
        assert isinstance(info.value, IsADirectoryError)
        with pytest.raises(NotADirectory) as info2:
            await sb.files.list("afile")
        assert info2.value.code is ErrorCode.NOT_A_DIRECTORY
