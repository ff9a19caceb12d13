"""``corral run`` as ``docker run`` users expect it, driven as a real process on real boxes:
byte-exact streamed output, flags checked in one line, refused workspaces, exit statuses,
signals that tear the box down, and a reader that goes away."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from corral.backends.host.state import state_root

pytestmark = pytest.mark.needs_bwrap

CORRAL = [sys.executable, "-m", "corral.cli"]


def corral(
    *args: str, cwd: Path | str | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CORRAL, *args], capture_output=True, cwd=cwd, input=stdin, timeout=60, check=False
    )


def test_binary_output_comes_back_byte_for_byte(workspace: Path) -> None:
    data = os.urandom(4096)
    (workspace / "r.bin").write_bytes(data)
    r = corral("run", "--", "cat", "r.bin", cwd=workspace)
    assert r.returncode == 0 and r.stdout == data


def test_gzip_through_corral_unzips(workspace: Path) -> None:
    (workspace / "f").write_bytes(b"hello\n" * 1000)
    r = corral("run", "--", "gzip", "-c", "f", cwd=workspace)
    unzipped = subprocess.run(["gunzip"], input=r.stdout, capture_output=True, check=True)
    assert unzipped.stdout == b"hello\n" * 1000


def test_large_output_is_not_truncated(workspace: Path) -> None:
    r = corral("run", "--", "head", "-c", "5000000", "/dev/zero", cwd=workspace)
    assert r.returncode == 0 and r.stdout == bytes(5_000_000) and r.stderr == b""


def test_each_stream_keeps_its_order(workspace: Path) -> None:
    script = "for i in 1 2 3 4 5; do echo o$i; echo e$i >&2; done"
    r = corral("run", "--", "sh", "-c", script, cwd=workspace)
    assert r.stdout == b"o1\no2\no3\no4\no5\n" and r.stderr == b"e1\ne2\ne3\ne4\ne5\n"


def test_json_capture_flags_truncation_and_says_so(workspace: Path) -> None:
    r = corral(
        "run",
        "--json",
        "--output-bytes",
        "1000",
        "--",
        "head",
        "-c",
        "5000",
        "/dev/zero",
        cwd=workspace,
    )
    data = json.loads(r.stdout)
    assert data["truncated"] is True and data["exit_code"] == 0
    assert b"output truncated" in r.stderr and b"--output-bytes" in r.stderr


def test_stdin_env_workdir_and_mount(workspace: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "x").write_text("from the host\n")
    r = corral(
        "run",
        "--stdin",
        "-e",
        "GREETING=hi",
        "-w",
        "/tmp",
        "-v",
        f"{shared}:/data",
        "--",
        "sh",
        "-c",
        'cat; echo "$GREETING"; pwd; cat /data/x; touch /data/y',
        cwd=workspace,
        stdin=b"piped\n",
    )
    assert r.stdout == b"piped\nhi\n/tmp\nfrom the host\n"
    assert r.returncode != 0 and not (shared / "y").exists()  # read-only unless :rw


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--timeout", "0", "greater than 0"),
        ("--timeout", "-1", "greater than 0"),
        ("--memory", "0", "from 16M to 8P"),
        ("--memory", "1k", "from 16M to 8P"),
        ("--memory", "9P", "from 16M to 8P"),
        ("--cpus", "0", "0.01 to 4096"),
        ("--cpus", "-1", "0.01 to 4096"),
        ("--pids", "1", "from 4 to 4194304"),
        ("--pids", "4194305", "from 4 to 4194304"),
    ],
)
def test_bad_flag_values_are_one_line_naming_the_flag(
    workspace: Path, flag: str, value: str, allowed: str
) -> None:
    r = corral("run", flag, value, "--", "true", cwd=workspace)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert flag in err and allowed in err
    assert "pydantic" not in err and "http" not in err and "Traceback" not in err


def test_json_errors_are_json(workspace: Path) -> None:
    r = corral("run", "--json", "--cpus", "-1", "--", "true", cwd=workspace)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "invalid_input"
    r = corral("run", "--json", "--", "no-such-tool", cwd=workspace)
    data = json.loads(r.stdout)
    assert r.returncode == 127 and data["exit_code"] == 127 and data["ended"] == "not_started"


def test_not_found_is_127_and_not_executable_126(workspace: Path) -> None:
    (workspace / "data.txt").write_text("not a program\n")
    r = corral("run", "--", "no-such-tool", cwd=workspace)
    assert r.returncode == 127 and b"command not found" in r.stderr
    assert b"Traceback" not in r.stderr
    r = corral("run", "--", "/workspace/data.txt", cwd=workspace)
    assert r.returncode == 126 and b"permission denied" in r.stderr


def test_killed_by_a_signal_is_128_plus_n(workspace: Path) -> None:
    r = corral("run", "--", "sh", "-c", "kill -USR1 $$", cwd=workspace)
    assert r.returncode == 128 + signal.SIGUSR1


def test_version() -> None:
    r = corral("--version")
    assert r.returncode == 0 and r.stdout.startswith(b"corral ")


@pytest.mark.parametrize("where", ["/", "/etc", "/usr/lib", "/var", "/proc", "HOME", "/root"])
def test_dangerous_workspaces_are_refused(where: str) -> None:
    path = os.path.expanduser("~") if where == "HOME" else where
    r = corral("run", "--", "touch", "corral-was-here", cwd=path)
    err = r.stderr.decode()
    assert r.returncode == 2 and "refusing" in err and "--force-workspace" in err, err
    assert not os.path.exists(os.path.join(path, "corral-was-here"))
    r = corral("run", "--workspace", path, "--", "true", cwd="/tmp")
    assert r.returncode == 2 and b"refusing" in r.stderr


def test_home_parent_is_refused_and_force_is_honoured(workspace: Path) -> None:
    r = corral("run", "--workspace", "/home", "--", "true")
    assert r.returncode == 2 and b"home directory" in r.stderr
    r = corral("run", "--force-workspace", "--workspace", "/etc", "--", "true")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_tears_the_box_down(workspace: Path, sig: signal.Signals) -> None:
    marker = f"1234.{int(sig)}"
    # The box's cgroup namespace hides its host group's name: the host finds it.
    script = f"echo up; exec sleep {marker}"
    proc = subprocess.Popen(
        [*CORRAL, "run", "--", "sh", "-c", script],
        cwd=workspace,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == b"up\n"
        found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True)
        seen = " ".join(
            Path(f"/proc/{pid.decode()}/cgroup").read_text() for pid in found.stdout.split()
        )
        box_id = re.findall(r"cb-[0-9a-f]+", seen)[0]
        state = state_root()
        assert (state / "boxes" / box_id).exists()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert not (state / "boxes" / box_id).exists()
    assert not list((state / "mnt").glob(f"{box_id}*"))
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, check=False)
    assert left.stdout == b""
    groups = subprocess.run(
        ["find", "/sys/fs/cgroup", "-maxdepth", "4", "-name", box_id],
        capture_output=True,
        check=False,
    )
    assert groups.stdout == b""


def test_a_reader_that_goes_away_is_no_traceback() -> None:
    result = subprocess.run(
        f"{sys.executable} -m corral.cli doctor --json | head -c 1",
        shell=True,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert b"Traceback" not in result.stderr and b"BrokenPipe" not in result.stderr


def test_streamed_output_to_a_closed_pipe_ends_the_command(workspace: Path) -> None:
    result = subprocess.run(
        f"{sys.executable} -m corral.cli run -- yes | head -c 100000 | wc -c",
        shell=True,
        cwd=workspace,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip() == b"100000" and b"Traceback" not in result.stderr


def test_shell_without_a_terminal_says_so(workspace: Path) -> None:
    r = corral("shell", cwd=workspace, stdin=b"")
    assert r.returncode == 2 and b"needs a terminal" in r.stderr and b"Traceback" not in r.stderr


def test_doctor_to_a_closed_pipe_is_no_traceback() -> None:
    """Every write meets EPIPE (the reader closed before corral wrote): exit 141, quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            [*CORRAL, "doctor", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert r.returncode == 141 and b"Traceback" not in r.stderr, r.stderr


def test_shell_banner_says_how_to_detach_and_picks_bash(workspace: Path) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: corral shell on this terminal
        _exec_in_child(workspace, "shell")
    seen = b""
    try:
        seen = _read_until(fd, b"detaches", seen)
        assert b"ctrl-] detaches" in seen and b"bash" in seen, seen
        os.write(fd, b"echo shell=$BASH_VERSION; exit 7\r")
        seen = _read_until(fd, b"shell=5", seen)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    finally:
        os.close(fd)
        if pid > 0:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _read_until(fd: int, wanted: bytes, seen: bytes = b"", timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if not ready:
            raise AssertionError(f"no {wanted!r} within {timeout} s; got {seen[-500:]!r}")
        try:
            seen += os.read(fd, 4096)
        except OSError:
            break
    return seen


def test_attach_says_why_when_the_owner_closes(workspace: Path) -> None:
    owner, owner_fd = pty.fork()
    if owner == 0:
        _exec_in_child(workspace, "shell")
    joiner, join_fd = -1, -1
    try:
        banner = _read_until(owner_fd, b"detaches")
        found = re.search(rb"session (\S+)\)", banner)
        assert found, banner
        joiner, join_fd = pty.fork()
        if joiner == 0:
            _exec_in_child(workspace, "attach", found.group(1).decode())
        os.write(join_fd, b"echo joined-$((40+2))\r")
        seen = _read_until(join_fd, b"joined-42")
        os.kill(owner, signal.SIGTERM)  # the owner tears its box down, then exits 143
        _, status = os.waitpid(owner, 0)
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM
        seen = _read_until(join_fd, b"sandbox owning it closed", seen)
        _, status = os.waitpid(joiner, 0)
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP  # the hang-up ended it
    finally:
        for pid, fd in ((owner, owner_fd), (joiner, join_fd)):
            if fd >= 0:
                os.close(fd)
            if pid > 0:  # never kill(-1): that is every process
                with contextlib.suppress(ChildProcessError, ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)


def _exec_in_child(cwd: Path, *args: str) -> None:
    """In a forked child: become corral, or exit at once (never go on running pytest)."""
    try:
        os.chdir(cwd)
        os.execv(sys.executable, [*CORRAL, *args])
    finally:
        os._exit(127)


def test_stdin_the_command_does_not_read_is_dropped_without_a_word(workspace: Path) -> None:
    # As `yes | head -1`: the command is done long before its input is.
    for _ in range(3):  # the reader thread's race with the end: it printed a traceback 4 of 4
        r = corral("run", "--stdin", "--", "head", "-1", cwd=workspace, stdin=b"y\n" * 4_000_000)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"y\n", b"")


def test_a_workspace_whose_name_is_not_utf8(workspace: Path) -> None:
    odd = workspace / os.fsdecode(b"ws\xff")
    odd.mkdir()
    (odd / "f").write_bytes(b"here\n")
    r = corral("run", "--", "cat", "f", cwd=odd)
    assert (r.returncode, r.stdout) == (0, b"here\n"), r.stderr


CONSOLE = [sys.executable, "-c", "from corral.client.cli import console; console()"]
"""The console script as installed (``corral``), not ``python -m corral.cli``."""


def test_output_that_cannot_be_written_is_one_line(workspace: Path) -> None:
    for args in (["run", "--", "echo", "hi"], ["run", "--json", "--", "echo", "hi"]):
        with open("/dev/full", "wb") as full:
            r = subprocess.run(
                [*CONSOLE, *args], cwd=workspace, stdout=full, stderr=subprocess.PIPE, timeout=60
            )
        assert r.returncode == 120, r.stderr
        assert r.stderr.endswith(b"corral: cannot write the output: No space left on device\n")
        assert b"Traceback" not in r.stderr


def test_closed_standard_fds_are_not_taken_by_corral_s_own_files(workspace: Path) -> None:
    # `corral run ... >&-`: fd 1 would be the first file corral opens, and get the output.
    script = 'exec "$@" >&- <&-'
    r = subprocess.run(
        ["sh", "-c", script, "sh", *CONSOLE, "run", "--", "echo", "hi"],
        cwd=workspace,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr


def test_ctrl_c_while_corral_is_still_importing_exits_130(workspace: Path) -> None:
    proc = subprocess.Popen(
        [*CONSOLE, "run", "--", "sleep", "30"], cwd=workspace, stderr=subprocess.PIPE
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 30
    while b"pydantic_core" not in maps.read_bytes():  # mid-import: its first compiled module
        assert time.monotonic() < deadline and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in err, err


def test_audit_of_a_directory_is_one_line(tmp_path: Path) -> None:
    r = corral("audit", str(tmp_path))
    assert r.returncode == 2 and b"Traceback" not in r.stderr
    says = f"corral audit: {tmp_path} is a directory; give the audit log file (the policy's "
    assert r.stderr == f"{says}audit_log)\n".encode()


def test_a_workspace_under_var_tmp_starts(tmp_path: Path) -> None:
    # /var/tmp is a link to /tmp in the box: the workspace's host-path alias cannot be made
    # there (bwrap failed as backend_failed, retryable); /var/tmp itself is refused as /tmp is.
    project = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="corral-test-")) / "proj"
    try:
        project.mkdir()
        r = corral("run", "--no-presets", "--", "pwd", cwd=project)
        assert (r.returncode, r.stdout) == (0, b"/workspace\n"), r.stderr
        r = corral("run", "--no-presets", "--", "pwd", cwd="/var/tmp")
        assert r.returncode == 2 and b"refusing /var/tmp" in r.stderr, r.stderr
    finally:
        shutil.rmtree(project.parent)


def test_json_output_says_when_bytes_were_not_utf8(workspace: Path) -> None:
    r = corral("run", "--json", "--", "printf", "a\\377b", cwd=workspace)
    assert r.returncode == 0 and json.loads(r.stdout)["stdout"] == "a\ufffdb"
    assert b"not UTF-8 is shown as U+FFFD" in r.stderr
    r = corral("run", "--json", "--", "printf", "plain", cwd=workspace)
    assert r.returncode == 0 and b"U+FFFD" not in r.stderr
