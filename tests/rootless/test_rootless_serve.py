"""``corral serve`` run by an ordinary user: its boxes are rootless ones, the CLI goes
through it, and what commands write belongs to the user."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import corral
from served import CORRAL, serving


def test_a_users_server_runs_rootless_boxes(tmp_path: Path, workspace: Path, mapped: bool) -> None:
    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        r = subprocess.run(
            [*CORRAL, "run", "--", "sh", "-c", "echo made > out.txt; id -u"],
            env=served.env,
            cwd=workspace,
            capture_output=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        # With subordinate ids commands are box uid 1000; without, box root with no caps.
        assert r.stdout == (b"1000\n" if mapped else b"0\n")
        assert (workspace / "out.txt").stat().st_uid == os.getuid()
        r = subprocess.run(
            [*CORRAL, "ps", "--json"],
            env=served.env,
            cwd=workspace,
            capture_output=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr


async def test_the_remote_sdk_says_rootless(tmp_path: Path) -> None:
    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        async with corral.connect(served.url) as remote, remote.Sandbox() as sb:
            info = await sb.info()
            assert info["backend"] == "bwrap-rootless"
            assert (await sb.run("echo hi")).stdout == "hi\n"
