"""The console script ends the process without the interpreter's module teardown
(:func:`corral.client.cli.exit_now`), yet does everything else a normal exit does: threads
joined, ``atexit`` handlers run, buffered output flushed, a gone reader reported. Each case
runs in a fresh interpreter; the last runs ``corral run`` itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CORRAL = [sys.executable, "-m", "corral"]


def _exit_now(body: str, **run: object) -> subprocess.CompletedProcess[bytes]:
    code = f"import sys\nfrom corral.client.cli import exit_now\n{body}\n"
    streams = {} if "stdout" in run else {"capture_output": True}
    # output buffered as it is by default (a shell may have set PYTHONUNBUFFERED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-c", code], env=env, timeout=60, check=False, **streams, **run
    )


def test_buffered_output_is_flushed_and_the_status_kept() -> None:
    body = "sys.stdout.write('x' * 3_000_000)\nsys.stderr.write('done')\nexit_now(7)"
    result = _exit_now(body)
    assert result.returncode == 7
    assert len(result.stdout) == 3_000_000 and result.stderr == b"done"


def test_other_threads_finish_and_atexit_handlers_run() -> None:
    body = """
import atexit, threading
release = threading.Event()
def worker():
    release.wait(30)
    for i in range(20000):
        print(i)
threading.Thread(target=worker).start()
atexit.register(lambda: print("atexit ran"))
release.set()
exit_now(0)
"""
    result = _exit_now(body)
    lines = result.stdout.decode().splitlines()
    assert result.returncode == 0, result.stderr
    # the worker printed everything before the atexit handler did: it was joined first
    assert lines[:-1] == [str(i) for i in range(20000)] and lines[-1] == "atexit ran"


def test_a_reader_that_went_away_is_141_without_a_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # stdout's reader is gone before anything is written
    try:
        result = _exit_now(
            "sys.stdout.write('kept in the buffer')\nexit_now(0)",
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141 and b"Traceback" not in result.stderr, result.stderr


@pytest.mark.needs_bwrap
def test_corral_run_keeps_the_commands_output_and_status(workspace: Path) -> None:
    script = "head -c 2000000 /dev/zero | tr '\\0' a; echo; echo to-stderr >&2; exit 3"
    result = subprocess.run(
        [*CORRAL, "run", "--", "sh", "-c", script],
        cwd=workspace,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == b"a" * 2_000_000 + b"\n" and result.stderr == b"to-stderr\n"
