"""Dangerous workspaces are refused by the library, the pool and the MCP server, not only by
the CLI (tests/test_cli_run.py): ``/``, system directories and home directories, unless the
caller says so explicitly. The box never starts, so nothing in them is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral import DangerousWorkspace, ErrorCode, Policy, Sandbox, SandboxPool
from corral.tools.mcp import ServerConfig
from corral.workspaces import workspace_danger

pytestmark = pytest.mark.needs_bwrap

HOME = os.path.realpath(os.path.expanduser("~"))
DANGEROUS = ["/", "/etc", "/usr/lib", "/var", "/proc", HOME, "/home"]


@pytest.mark.parametrize("where", DANGEROUS)
async def test_the_library_refuses_with_the_cause_and_the_fix(where: str) -> None:
    sb = Sandbox(Policy(), workspace=where)
    with pytest.raises(DangerousWorkspace) as info:
        await sb.start()
    err = info.value
    assert err.code == ErrorCode.INVALID_INPUT
    assert (err.workspace, err.reason) == (os.path.realpath(where), workspace_danger(where))
    assert "allow_dangerous_workspace=True" in err.message and err.reason in err.message
    assert err.to_dict()["error"]["code"] == "invalid_input"
    await sb.aclose()


def test_project_and_temporary_directories_are_fine(workspace: Path) -> None:
    assert workspace_danger(workspace) is None
    assert workspace_danger("/tmp/project") is None
    assert workspace_danger(os.path.join(HOME, "project")) is None  # inside a home: fine


async def test_the_library_shares_it_when_told_to(loop_watch: None) -> None:
    async with Sandbox(Policy(), workspace="/etc", allow_dangerous_workspace=True) as sb:
        r = await sb.run("test -f /workspace/passwd")  # the host's /etc, read-write
        assert r.exit_code == 0


async def test_the_pool_refuses_on_its_warm_path_too() -> None:
    async with SandboxPool(size=1) as pool:
        with pytest.raises(DangerousWorkspace, match="allow_dangerous_workspace"):
            await pool.run("touch /workspace/corral-was-here", workspace="/etc")
        with pytest.raises(DangerousWorkspace):
            await pool.run("true", workspace=HOME)
    assert not os.path.exists("/etc/corral-was-here")


def test_the_mcp_server_config_refuses_and_can_be_forced() -> None:
    with pytest.raises(DangerousWorkspace) as info:
        ServerConfig(workspace=Path("/"))
    assert info.value.reason == "it is the host's root directory"
    forced = ServerConfig(workspace=Path("/"), allow_dangerous_workspace=True)
    assert forced.allow_dangerous_workspace


def test_corral_mcp_refuses_before_serving() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "corral", "mcp", "--workspace", "/etc"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    err = r.stderr.decode()
    assert r.returncode == 2 and "refusing /etc" in err and "--force-workspace" in err, err


def _venv_with_script(workspace: Path) -> Path:
    """A venv made on the host (no pip: fast), and a script whose #! names the venv's
    interpreter by the workspace's host path, as pip's entry points do."""
    subprocess.run(
        ["/usr/bin/python3", "-m", "venv", "--without-pip", str(workspace / ".venv")], check=True
    )
    script = workspace / ".venv" / "bin" / "hello"
    script.write_text(
        f"#!{workspace}/.venv/bin/python3\nimport sys\nprint('hello from', sys.prefix)\n"
    )
    script.chmod(0o755)
    return script


async def test_a_host_made_venv_runs_its_scripts_in_the_box(workspace: Path) -> None:
    _venv_with_script(workspace)
    async with Sandbox(workspace=workspace) as sb:
        r = await sb.run(".venv/bin/hello")
        assert (r.exit_code, r.stdout) == (0, f"hello from {workspace}/.venv\n"), r.stderr
        # The host path is a link to the workdir: writes through it land in the workspace.
        r = await sb.run(f"echo via-alias > {workspace}/made.txt && readlink {workspace}")
        assert r.stdout == "/workspace\n"
    assert (workspace / "made.txt").read_text() == "via-alias\n"


async def test_the_pool_gives_a_venv_workspace_a_box_that_runs_it(workspace: Path) -> None:
    _venv_with_script(workspace)
    async with SandboxPool(size=1) as pool:
        r = await pool.run(".venv/bin/hello", workspace=workspace)
    assert r.exit_code == 0, r.stderr


def test_a_homes_own_dot_directories_are_refused(tmp_path: Path) -> None:
    # `corral run` from ~/.config or ~/.ssh gave the box gh's token, ssh keys and every tool's
    # settings read-write; a project somewhere below a dot directory stays fine.
    for name in (".config", ".ssh", ".aws"):
        reason = workspace_danger(os.path.join(HOME, name))
        assert reason is not None and name in reason
    assert workspace_danger(os.path.join(HOME, ".ssh", "keys")) is not None
    assert workspace_danger(os.path.join(HOME, ".local", "src", "project")) is None
