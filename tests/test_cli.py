"""The `corral` command, run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_bwrap


def corral(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        input=stdin,
        timeout=60,
        check=False,
    )


def test_run_propagates_exit_code_and_streams(workspace: Path) -> None:
    r = corral(
        "run", "--workspace", str(workspace), "--", "sh", "-c", "echo out; echo err >&2; exit 5"
    )
    assert (r.returncode, r.stdout, r.stderr) == (5, "out\n", "err\n")


def test_run_defaults_to_the_current_directory(workspace: Path) -> None:
    r = corral("run", "--", "sh", "-c", "echo made > made.txt; pwd", cwd=workspace)
    assert r.returncode == 0 and r.stdout == "/workspace\n"
    assert (workspace / "made.txt").read_text() == "made\n"


def test_run_json(workspace: Path) -> None:
    r = corral("run", "--json", "--workspace", str(workspace), "--", "echo", "hi")
    data = json.loads(r.stdout)
    assert data["exit_code"] == 0 and data["stdout"] == "hi\n" and data["timed_out"] is False
    assert set(data) >= {"exit_code", "stdout", "stderr", "timed_out", "duration_ms"}


def test_run_timeout_exits_124(workspace: Path) -> None:
    r = corral("run", "--timeout", "0.5", "--workspace", str(workspace), "--", "sleep", "30")
    assert r.returncode == 124 and "timed out" in r.stderr


def test_run_timeout_of_the_policy_file_exits_124(workspace: Path, tmp_path: Path) -> None:
    """The policy's exec_timeout_secs fires with no --timeout given: reported, no crash."""
    policy = tmp_path / "p.toml"
    policy.write_text("[limits]\nexec_timeout_secs = 0.5\nkill_grace_secs = 0.5\n")
    r = corral("run", "--policy", str(policy), "--workspace", str(workspace), "--", "sleep", "30")
    assert r.returncode == 124 and "Traceback" not in r.stderr
    assert "corral: timed out after 0.5 s" in r.stderr


def test_run_json_reports_the_timeout_and_how_it_ended(workspace: Path) -> None:
    r = corral(
        "run", "--json", "--timeout", "0.5", "--workspace", str(workspace), "--", "sleep", "9"
    )
    data = json.loads(r.stdout)
    assert (data["timeout"], data["ended"], data["timed_out"]) == (0.5, "timed_out", True)
    assert data["exit_code"] == -15  # sleep dies of the SIGTERM, no SIGKILL needed


def test_run_limits_from_flags(workspace: Path) -> None:
    r = corral(
        "run",
        "--memory",
        "64M",
        "--pids",
        "16",
        "--workspace",
        str(workspace),
        "--",
        "python3",
        "-c",
        "bytearray(300 << 20)",
    )
    assert r.returncode == 137
    assert "memory limit" in r.stderr


def test_policy_file_errors_are_one_line(workspace: Path, tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[limits]\nmax_pid = 3\n")
    r = corral("run", "--policy", str(bad), "--workspace", str(workspace), "--", "true")
    assert r.returncode == 2
    assert "limits.max_pid" in r.stderr and "Traceback" not in r.stderr


def test_run_without_command_is_usage_error() -> None:
    r = corral("run")
    assert r.returncode == 2 and "give a command" in r.stderr


def test_missing_program_is_reported_without_traceback(workspace: Path) -> None:
    r = corral("run", "--workspace", str(workspace), "--", "no-such-tool")
    assert r.returncode == 127  # as a shell says it
    assert "no-such-tool: command not found" in r.stderr and "Traceback" not in r.stderr


def test_doctor_reports_and_passes_here() -> None:
    r = corral("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert r.returncode == 0
    assert checks["bwrap"]["ok"] and checks["sandbox"]["ok"]
    assert "cgroups" in checks and "landlock" in checks
    assert checks["idmapped mounts"]["ok"], checks["idmapped mounts"]  # kernel 6.x, ext4 here
