"""Toolchains from the operator's home: picked from the workspace, shared read-only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.tools import presets

pytestmark = pytest.mark.needs_bwrap

PYENV = Path("~/.pyenv").expanduser()
CORRAL = [sys.executable, "-m", "corral"]


def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    (home / ".cargo" / "bin").mkdir(parents=True)
    (home / ".cargo" / "bin" / "cargo").write_text("#!/bin/sh\necho fake cargo\n")
    (home / ".rustup").mkdir()
    node = home / ".nvm" / "versions" / "node"
    for version in ("v18.20.1", "v20.11.0", "v9.0.0"):
        (node / version / "bin").mkdir(parents=True)
        (node / version / "bin" / "node").write_text(f"#!/bin/sh\necho node {version}\n")
        (node / version / "bin" / "node").chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NVM_DIR", raising=False)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    return home


def test_presets_are_picked_from_the_workspaces_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = fake_home(tmp_path, monkeypatch)
    ws = tmp_path / "ws"
    ws.mkdir()
    assert presets.detect(ws) == {}
    (ws / "Cargo.toml").write_text("[package]\n")
    (ws / "package.json").write_text("{}\n")
    (ws / "pyproject.toml").write_text("[project]\n")  # no pyenv here: nothing to share
    assert sorted(presets.detect(ws)) == ["node", "rust"]
    # nvm's default alias picks the version; without one, the newest (not by string order).
    assert presets.nvm_node() == home / ".nvm/versions/node/v20.11.0"
    (home / ".nvm" / "alias").mkdir()
    (home / ".nvm" / "alias" / "default").write_text("18\n")
    assert presets.nvm_node() == home / ".nvm/versions/node/v18.20.1"


def test_a_venv_whose_interpreter_the_box_cannot_see_asks_for_the_python_preset(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    (ws / ".venv").mkdir(parents=True)
    (ws / ".venv" / "pyvenv.cfg").write_text(f"home = {tmp_path}/py/bin\nversion = 3.12\n")
    (tmp_path / "py" / "bin").mkdir(parents=True)
    assert presets.hidden_venv_bases(ws) == []  # a directory, no Python installation
    (tmp_path / "py" / "bin" / "python3").write_text("")
    (tmp_path / "py" / "lib" / "python3.12").mkdir(parents=True)
    (tmp_path / "py" / "lib" / "python3.12" / "os.py").write_text("")
    assert presets.hidden_venv_bases(ws) == [str(tmp_path / "py")]
    assert "python" in presets.detect(ws)
    policy = presets.python_toolchain(Policy(), pyenv_root=tmp_path / "none", workspace=ws)
    assert [(str(m.host), m.guest, m.mode) for m in policy.filesystem.mounts] == [
        (str(tmp_path / "py"), str(tmp_path / "py"), "ro")
    ]
    assert presets.venv_hints(ws, policy) == []
    (hint,) = presets.venv_hints(ws, Policy())
    assert "--preset python" in hint
    # A venv of the system's python needs nothing.
    (ws / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert presets.hidden_venv_bases(ws) == [] and presets.detect(ws) == {}


async def test_node_preset_puts_nvms_node_first_in_a_real_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workspace: Path
) -> None:
    home = fake_home(tmp_path, monkeypatch)
    home.chmod(0o755)
    policy = presets.node_toolchain(Policy())
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("node; ls -ld /home/user")
    assert r.stdout.splitlines()[0] == "node v20.11.0", r.stderr
    assert r.stdout.splitlines()[1].split()[0] == "drwxr-xr-x"  # the home stays the user's


@pytest.fixture
def pyenv_venv(workspace: Path) -> Path:
    if not (PYENV / "versions").is_dir():
        pytest.skip("no pyenv in the home here")
    base = max((PYENV / "versions").iterdir()) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(workspace / ".venv")], check=True)
    return workspace / ".venv"


async def test_a_venv_made_with_a_pyenv_python_runs_with_the_preset(
    pyenv_venv: Path, workspace: Path
) -> None:
    async with Sandbox(Policy(), workspace=workspace) as sb:
        assert any("--preset python" in w for w in sb.warnings)
        r = await sb.run([".venv/bin/python", "-c", "print('venv ok')"])
        assert r.exit_code == 127
    policy = presets.python_toolchain(Policy(), workspace=workspace)
    async with Sandbox(policy, workspace=workspace) as sb:
        assert not sb.warnings
        r = await sb.run(".venv/bin/python -c \"print('venv ok')\"; python --version")
        assert r.stdout.splitlines()[0] == "venv ok", r.stderr
        assert r.exit_code == 0, r.stderr  # pyenv's shims, read-only


@pytest.mark.skipif(
    not Path("~/.cargo/bin/cargo").expanduser().exists(), reason="no rustup in the home here"
)
def test_corral_run_in_a_crate_just_works(tmp_path: Path) -> None:
    crate = tmp_path / "crate"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text('[package]\nname = "demo"\nversion = "0.1.0"\n')
    (crate / "src" / "main.rs").write_text('fn main() { println!("hi from rust"); }\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    r = subprocess.run(
        [*CORRAL, "run", "--", "cargo", "--version"],
        cwd=crate,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0 and r.stdout.startswith("cargo "), r.stderr
    assert "corral: preset rust (Cargo.toml" in r.stderr
    r = subprocess.run(
        [*CORRAL, "run", "--no-presets", "--", "cargo", "--version"],
        cwd=crate,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 127 and "preset" not in r.stderr


def test_corral_mcp_picks_presets_for_its_workspace_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from corral.cli import make_parser
    from corral.cli.mcp import config_from_args

    fake_home(tmp_path, monkeypatch)
    ws = tmp_path / "crate"
    ws.mkdir()
    (ws / "Cargo.toml").write_text("[package]\n")
    parser = make_parser()
    config = config_from_args(parser.parse_args(["mcp", "--workspace", str(ws)]))
    assert [m.guest for m in config.policy.filesystem.mounts] == [
        "/toolchains/cargo",
        "/toolchains/rustup",
    ]
    assert "preset rust" in capsys.readouterr().err
    config = config_from_args(parser.parse_args(["mcp", "--workspace", str(ws), "--no-presets"]))
    assert config.policy.filesystem.mounts == ()


async def test_a_venv_config_a_box_planted_is_read_as_hostile(
    tmp_path: Path, workspace: Path
) -> None:
    """Host code reads a workspace venv's pyvenv.cfg (``corral run``'s presets, the
    library's warnings), often as root: a link the box planted there must not be followed
    (to /dev/zero it ate host memory) and a FIFO must not block it (the event loop)."""
    import asyncio

    hidden = tmp_path / "py"
    (hidden / "bin").mkdir(parents=True)
    host_file = tmp_path / "host.cfg"
    host_file.write_text(f"home = {hidden}/bin\n")
    async with Sandbox(workspace=workspace) as sb:
        r = await sb.run(
            f"mkdir .venv venv && ln -s {host_file} .venv/pyvenv.cfg && mkfifo venv/pyvenv.cfg"
        )
        assert r.exit_code == 0, r.stderr
        assert (workspace / ".venv" / "pyvenv.cfg").is_symlink()
        async with asyncio.timeout(10):  # a FIFO read would block its thread for ever
            bases = await asyncio.to_thread(presets.hidden_venv_bases, workspace)
            warnings = await asyncio.to_thread(lambda: sb.warnings)
    assert bases == []  # the link's target, the host's file, was not read
    assert not any("venv" in w for w in warnings), warnings


async def test_a_venv_config_a_box_wrote_shares_no_host_directory(
    tmp_path: Path, workspace: Path
) -> None:
    """The home a box writes in its workspace's pyvenv.cfg is shared with the next box only
    when it is a Python installation: it named any host directory (a root-only one, logs,
    another project), which the python preset then mounted into the next box."""
    secret = tmp_path / "hostsecret"
    (secret / "bin").mkdir(parents=True)
    (secret / "key").write_text("TOPSECRET")
    async with Sandbox(workspace=workspace) as sb:
        r = await sb.run(f"mkdir .venv && echo 'home = {secret}/bin' > .venv/pyvenv.cfg")
        assert r.exit_code == 0, r.stderr
    assert presets.hidden_venv_bases(workspace) == []
    assert "python" not in presets.detect(workspace)
