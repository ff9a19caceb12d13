"""Attach and hand-off: `corral attach` / `corral shell` driven on real terminals.

The CLI runs in a separate process on a PTY pair made here (or under tmux), so raw mode,
detach keys and window sizes are the real thing. Everything waits on events: output read
from the terminal goes through the same sans-IO Expecter the library uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import PROMPT, rootless_skip
from corral import Policy, Sandbox
from corral.errors import SandboxError
from corral.sessions import attach
from corral.sessions.expect import Case, ExpectBuffer, Expecter, Match
from corral.sessions.pty import PtySession
from corral.sessions.terminal import DetachDetector, parse_detach_keys
from corral.tools import Toolbox
from corral.tools.mcp import ServerConfig

pytestmark = pytest.mark.usefixtures("sessions_dir")

PLAN_SCRIPT = """\
echo "Plan: 1 to add, 0 to change, 0 to destroy."
printf "  Enter a value: "
read answer
[ "$answer" = yes ] && echo "Apply complete! Resources: 1 added." || echo "Apply cancelled."
"""


# ---- detach keys (pure) ---------------------------------------------------------------------
def test_detach_keys_use_the_docker_syntax() -> None:
    assert parse_detach_keys("ctrl-]") == b"\x1d"
    assert parse_detach_keys("ctrl-q") == b"\x11"
    assert parse_detach_keys("ctrl-p,ctrl-q") == b"\x10\x11"
    assert parse_detach_keys("ctrl-@, x") == b"\x00x"
    for bad in ("", "ctrl-", "ctrl-1", "alt-x", "ab"):
        with pytest.raises(SandboxError):
            parse_detach_keys(bad)


def test_detach_detector_forwards_everything_but_the_sequence() -> None:
    d = DetachDetector(b"\x10\x11")
    assert d.feed(b"ls\r") == (b"ls\r", False)
    assert d.feed(b"a\x10") == (b"a", False)  # held: might be the start of detach
    assert d.feed(b"b") == (b"\x10b", False)  # it was not: forwarded after all
    assert d.feed(b"\x10\x10") == (b"\x10", False)
    assert d.feed(b"\x11rest") == (b"", True)


@given(st.binary(max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_detach_detection_does_not_depend_on_chunking(data: bytes, cuts: list[int]) -> None:
    keys = b"\x10\x11"
    whole = DetachDetector(keys).feed(data)
    chunked = DetachDetector(keys)
    forwarded, detached = b"", False
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for a, b in itertools.pairwise(bounds):
        out, detached = chunked.feed(data[a:b])
        forwarded += out
        if detached:
            break
    assert (forwarded, detached) == whole


# ---- a real terminal on the host, read event-driven ----------------------------------------
class Terminal:
    """A PTY pair on the host with the corral CLI on its slave side."""

    def __init__(self, cols: int = 100, rows: int = 30) -> None:
        self.master, slave = os.openpty()
        self.slave: int | None = slave
        self.set_size(cols, rows)
        self.buffer = ExpectBuffer()
        self.waiter: tuple[Expecter, asyncio.Future[Match]] | None = None
        self.proc: asyncio.subprocess.Process | None = None

    def set_size(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    async def start(self, *args: str) -> None:
        await self.start_program(sys.executable, "-m", "corral.cli", *args)

    async def start_program(self, *argv: str) -> None:
        assert self.slave is not None
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=self.slave, stdout=self.slave, stderr=self.slave, start_new_session=True,
        )  # fmt: skip
        os.close(self.slave)
        self.slave = None
        asyncio.get_running_loop().add_reader(self.master, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every process on the terminal has gone
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.master)
        waiter = self.waiter
        if waiter is None:
            self.buffer.feed_eof() if not data else self.buffer.feed(data)
            return
        result = waiter[0].feed(data) if data else waiter[0].feed_eof()
        if result is not None and not waiter[1].done():
            waiter[1].set_result(result)

    async def expect(self, pattern: str, timeout: float = 15) -> Match:
        expecter = Expecter(self.buffer, [Case(pattern)])
        result = expecter.check()
        if result is None:
            future: asyncio.Future[Match] = asyncio.get_running_loop().create_future()
            self.waiter = (expecter, future)
            try:
                async with asyncio.timeout(timeout):
                    result = await future
            except TimeoutError:
                result = expecter.timeout()
            finally:
                self.waiter = None
        assert result.matched, f"terminal never showed {pattern!r}; it shows {result.output!r}"
        return result

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    async def exit_status(self, timeout: float = 15) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            return await self.proc.wait()

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)
        if self.slave is not None:
            os.close(self.slave)


@pytest.fixture
async def terminals() -> AsyncIterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for term in made:
        await term.close()


async def attach_cli(
    terminals: list[Terminal], sh: PtySession, *extra: str, cols: int = 100, rows: int = 30
) -> Terminal:
    term = Terminal(cols, rows)
    terminals.append(term)
    await term.start("attach", sh.session_id, *extra)
    async with asyncio.timeout(15):
        await sh.wait_attached()
    return term


@pytest.fixture
async def sh(sandbox: Sandbox) -> AsyncIterator[PtySession]:
    """A shared shell session (one a human can attach to), at its first prompt."""
    session = await sandbox.shell(shared=True)
    assert (await session.expect(PROMPT, 10)).matched
    yield session
    await session.close()


# ---- the session server ---------------------------------------------------------------------
@pytest.mark.needs_bwrap
async def test_a_shell_opens_no_socket_until_it_is_shared(
    sandbox: Sandbox, sessions_dir: Path
) -> None:
    private = await sandbox.shell()
    other = await sandbox.shell()
    sock = sessions_dir / f"{os.getpid()}.sock"
    assert not sock.exists() and not sessions_dir.exists()
    assert await asyncio.to_thread(attach.list_sessions) == []

    assert await sandbox.share(private) == sock
    assert await sandbox.share(private) == sock  # sharing twice is one share
    listed = await asyncio.to_thread(attach.list_sessions)
    assert [s["session_id"] for _, s in listed] == [private.session_id]  # not `other`
    await other.close()
    assert sock.exists()
    await private.close()
    assert not sock.exists()  # the server stops with its last shared session
    with pytest.raises(SandboxError):
        await sandbox.share(private)  # a closed session cannot be shared


@pytest.mark.needs_bwrap
async def test_closing_the_sandbox_stops_serving_its_shared_sessions(
    box_policy: Policy, workspace: Path, sessions_dir: Path
) -> None:
    async with Sandbox(box_policy, workspace=workspace) as sb:
        await sb.shell(shared=True)
        assert (sessions_dir / f"{os.getpid()}.sock").exists()
    assert not (sessions_dir / f"{os.getpid()}.sock").exists()


@pytest.mark.needs_bwrap
async def test_sessions_are_served_on_a_private_socket(
    sandbox: Sandbox, sessions_dir: Path
) -> None:
    sh = await sandbox.shell(shared=True)
    sock = sessions_dir / f"{os.getpid()}.sock"
    assert stat.S_IMODE(sessions_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    listed = await asyncio.to_thread(attach.list_sessions)
    assert [(p, s["session_id"], s["shell"]) for p, s in listed] == [
        (sock, sh.session_id, "/bin/sh")
    ]
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "corral.cli", "sessions", "--json", stdout=subprocess.PIPE
    )
    out, _ = await cli.communicate()
    assert [s["session_id"] for s in json.loads(out)] == [sh.session_id]
    await sh.close()
    assert not sock.exists()  # the server stops with its last session


@pytest.mark.needs_bwrap
@rootless_skip(
    "this process cannot act as another user; a user's session sockets are in its own "
    "private directory, and the server checks the peer's uid as in root mode"
)
async def test_other_users_are_refused(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # Somewhere another uid can reach (pytest's tmp dirs are 0700 all the way up).
    public = Path(tempfile.mkdtemp(prefix="corral-test-"))
    monkeypatch.setenv("CORRAL_SESSIONS_DIR", str(public / "sessions"))
    try:
        sh = await sandbox.shell(shared=True)
        sock = public / "sessions" / f"{os.getpid()}.sock"
        # Open the directory and socket up, so only the SO_PEERCRED check stands in the way.
        for path, mode in ((public, 0o755), (sock.parent, 0o755), (sock, 0o666)):
            os.chmod(path, mode)
        probe = (
            "import socket,sys,struct,json\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "h = json.dumps({'op': 'list'}).encode()\n"
            "try:\n"
            "    s.sendall(struct.pack('>II', len(h), 0) + h); print(repr(s.recv(100)))\n"
            "except OSError:\n"
            "    print(repr(b''))  # hung up on before the request was even read\n"
        )
        # setpriv, not user=: with user= Python forks the whole test process on the loop.
        as_nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")
        other = await asyncio.create_subprocess_exec(
            *as_nobody, sys.executable, "-I", "-S", "-c", probe, str(sock), cwd="/",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await other.communicate()
        assert out.strip() == b"b''"  # hung up on, without a word about the sessions
        assert sh.session_id.encode() not in out
        await sh.close()
    finally:
        shutil.rmtree(public, ignore_errors=True)


# ---- attach from another process ------------------------------------------------------------
@pytest.mark.needs_bwrap
async def test_attach_detach_and_reattach(sh: PtySession, terminals: list[Terminal]) -> None:
    await sh.write("echo before-$((6*7))\n")
    assert (await sh.expect("before-42", 10)).matched
    term = await attach_cli(terminals, sh)
    await term.expect("before-42")  # the recent screen is replayed
    assert (sh.cols, sh.rows) == (100, 30)  # the human's window size is forwarded
    term.type(b"echo typed-by-$((1+1))-human\r")
    await term.expect("typed-by-2-human")  # the human sees the output...
    assert (await sh.expect("typed-by-2-human", 10)).matched  # ...and so does the agent
    term.set_size(120, 40)
    assert term.proc is not None
    term.proc.send_signal(signal.SIGWINCH)  # what the kernel does for a resized terminal
    # The client handles SIGWINCH and our typing in one loop, in either order: ask again
    # (each answer is awaited as an event) until the new size has reached the shell.
    sizes = []
    for _ in range(20):
        term.type(b"stty size\r")
        # The echo of a line typed early can come before the previous prompt: skip it.
        sizes.append((await term.expect(r"\n(?:\$ )?(\d+ \d+)\r?\n")).captures[1])
        if sizes[-1] == "40 120":
            break
    assert sizes[-1] == "40 120", sizes
    term.type(b"\x1d")  # Ctrl-]
    await term.expect("detached from session")
    assert await term.exit_status() == 0
    async with asyncio.timeout(10):
        await sh.wait_attached(False)
    assert (sh.cols, sh.rows) == (80, 24)  # the agent's size is back once nobody looks

    await sh.write("echo still-$((2+3))-alive\n")  # the session survived the detach
    assert (await sh.expect("still-5-alive", 10)).matched
    again = await attach_cli(terminals, sh, "--detach-keys", "ctrl-p,ctrl-q")
    await again.expect("still-5-alive")
    again.type(b"\x10\x11")
    await again.expect("detached")
    assert await again.exit_status() == 0
    assert not sh.closed


@pytest.mark.needs_bwrap
async def test_human_types_yes_while_the_agent_waits(
    sh: PtySession, workspace: Path, terminals: list[Terminal]
) -> None:
    (workspace / "plan.sh").write_text(PLAN_SCRIPT)
    await sh.write("sh plan.sh\n")
    prompt = await sh.expect("Enter a value:", 10)
    assert "Plan: 1 to add" in prompt.output
    term = await attach_cli(terminals, sh)  # the agent hands the terminal to the human
    await term.expect("Enter a value:")
    term.type(b"yes\r")
    done = await sh.expect("Apply complete!", 10)
    assert done.matched and "yes" in done.output
    await term.expect("Apply complete!")
    term.type(b"\x1d")
    assert await term.exit_status() == 0


@pytest.mark.needs_bwrap
async def test_shell_exit_ends_the_attached_client_with_its_status(
    sh: PtySession, terminals: list[Terminal]
) -> None:
    term = await attach_cli(terminals, sh)
    term.type(b"exit 3\r")
    assert await term.exit_status() == 3
    assert (await sh.expect("never printed", 10)).reason == "eof"


@pytest.mark.needs_bwrap
async def test_attach_to_an_unknown_session_fails_cleanly(
    sh: PtySession, terminals: list[Terminal]
) -> None:
    term = Terminal()
    terminals.append(term)
    await term.start("attach", "no-such-session")
    await term.expect("session_not_found")
    assert await term.exit_status() != 0


async def test_attach_from_input_that_cannot_be_waited_on_is_one_line(
    sh: PtySession, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_bytes(b"echo hi\n")
    for source in (os.devnull, str(keys)):
        stdin = os.open(source, os.O_RDONLY)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "corral.cli", "attach", sh.session_id,
                stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        finally:
            os.close(stdin)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2 and b"cannot be waited on" in err, err
        assert b"Traceback" not in err and err.count(b"\n") == 1
    assert sh.attached == 0


@pytest.mark.needs_bwrap
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_attach_under_tmux(sh: PtySession, tmp_path: Path) -> None:
    server = f"corral-test-{os.getpid()}"
    result = tmp_path / "attach-exit"
    inner = (
        f"{sys.executable} -m corral.cli attach {sh.session_id}; "
        f"echo $? > {result}; tmux -L {server} wait-for -S attach-done; exec cat"
    )  # cat holds the session (and so the tmux server) until kill-server: a wait-for that
    # comes after the signal must still find the server (it exited with the last session)
    tmux = ["tmux", "-L", server, "-f", "/dev/null"]
    await _run(*tmux, "new-session", "-d", "-x", "90", "-y", "25", inner)
    try:
        async with asyncio.timeout(15):
            await sh.wait_attached()
        await _run(*tmux, "send-keys", "echo via-tm''ux", "Enter")
        assert (await sh.expect("via-tmux", 10)).matched
        assert (sh.cols, sh.rows) == (90, 25)
        await _run(*tmux, "send-keys", "C-]")
        async with asyncio.timeout(15):
            await _run(*tmux, "wait-for", "attach-done")
        assert result.read_text().strip() == "0"
        assert not sh.closed
    finally:
        await _run(*tmux, "kill-server", check=False)


async def _run(*argv: str, check: bool = True) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stderr=subprocess.DEVNULL)
    code = await proc.wait()
    assert code == 0 or not check, f"{argv} exited with {code}"


# ---- corral shell ---------------------------------------------------------------------------
@pytest.mark.needs_bwrap
async def test_corral_shell_detaches_and_is_reattachable(
    workspace: Path, terminals: list[Terminal]
) -> None:
    term = Terminal()
    terminals.append(term)
    await term.start("shell", "--workspace", str(workspace))
    await term.expect(r"\$ ")
    term.type(b"echo in-$((3*3))-box > made-here; echo wro''te\r")
    await term.expect("wrote")
    term.type(b"\x1d")
    detached = await term.expect(r"corral attach (\S+)")
    session_id = detached.captures[1]
    assert (workspace / "made-here").read_text() == "in-9-box\n"

    back = Terminal()
    terminals.append(back)
    await back.start("attach", session_id)
    await back.expect("made-here")  # the replay: the attach is up
    back.type(b"exit 5\r")
    assert await back.exit_status() == 5
    assert await term.exit_status() == 5  # `corral shell` ends with its shell


@pytest.mark.needs_bwrap
async def test_agent_shells_are_attachable_only_when_the_toolbox_shares_them(
    sandbox: Sandbox,
) -> None:
    assert ServerConfig().share_shells  # the MCP server's default: the human hand-off
    private = await Toolbox(sandbox).call("open_shell", {})
    assert await asyncio.to_thread(attach.list_sessions) == []
    shared = await Toolbox(sandbox, share_shells=True).call("open_shell", {})
    listed = await asyncio.to_thread(attach.list_sessions)
    assert [s["session_id"] for _, s in listed] == [shared["session_id"]]
    assert private["session_id"] != shared["session_id"]


# ---- the library: Sandbox.attach / attach_shell / reattach on the caller's own terminal ------
SYNC_PROGRAM = """\
import sys, corral
with corral.SyncSandbox(workspace=sys.argv[1]) as sb:
    r = sb.attach("sh", env={"GREETING": "hi"}, cwd="/tmp", detach_keys="ctrl-q")
    print(f"\\r\\nFIRST {r.reason} {r.exit_code} {r.session_id}", flush=True)
    r = sb.reattach(r.session_id, detach_keys="ctrl-q")
    print(f"\\r\\nSECOND {r.reason} {r.exit_code}", flush=True)
"""

ASYNC_PROGRAM = """\
import asyncio, sys, corral
async def main():
    async with corral.Sandbox(workspace=sys.argv[1]) as sb:
        r = await sb.attach(["python3", "-q"], detach_keys="ctrl-p,ctrl-q")
        print(f"\\r\\nDONE {r.reason} {r.exit_code}", flush=True)
        r = await sb.attach_shell()
        print(f"\\r\\nSHELL {r.reason} {r.exit_code}", flush=True)
asyncio.run(main())
"""


@pytest.mark.needs_bwrap
async def test_sync_attach_detach_with_ctrl_q_and_reattach(
    workspace: Path, terminals: list[Terminal]
) -> None:
    """The spec's attach from a program: its terminal in raw mode bridged to a PTY in the
    box (env, cwd, window size and SIGWINCH), ctrl-q detaches, re-attach by session id."""
    term = Terminal(cols=100, rows=30)
    terminals.append(term)
    await term.start_program(sys.executable, "-c", SYNC_PROGRAM, str(workspace))
    await term.expect(r"\$ ", timeout=60)
    term.type(b"echo $GREETING-$(pwd)\r")
    await term.expect("hi-/tmp")
    term.type(b"stty size\r")
    await term.expect("30 100")
    term.set_size(120, 40)  # the program has no controlling terminal here: signal it
    assert term.proc is not None
    term.proc.send_signal(signal.SIGWINCH)
    for _ in range(50):  # the resize travels as a message: ask until the box sees it
        term.type(b"stty size\r")
        with contextlib.suppress(AssertionError):
            await term.expect("40 120", timeout=0.2)
            break
    else:
        pytest.fail("the box never saw the new window size")
    term.type(b"echo still-$((2+2))\r")
    await term.expect("still-4")
    term.type(b"\x11")  # ctrl-q
    first = await term.expect(r"FIRST detached None (\S+)")
    assert first.captures[1]
    await term.expect("still-4")  # re-attached: the replay of the screen
    term.type(b"exit 7\r")
    await term.expect("SECOND exited 7")
    assert await term.exit_status() == 0


@pytest.mark.needs_bwrap
async def test_async_attach_forwards_ctrl_c_and_returns_the_exit_code(
    workspace: Path, terminals: list[Terminal]
) -> None:
    term = Terminal()
    terminals.append(term)
    await term.start_program(sys.executable, "-c", ASYNC_PROGRAM, str(workspace))
    await term.expect(">>> ", timeout=60)
    term.type(b"while True: pass\r\r")
    await term.expect(r"\.\.\. \r\n")
    term.type(b"\x03")  # raw mode: Ctrl-C is a key for the box, not a signal for the host
    await term.expect("KeyboardInterrupt")
    term.type(b"import sys; sys.exit(3)\r")
    await term.expect("DONE exited 3")
    await term.expect(r"\$ ")  # attach_shell: bash if the box has it, else sh
    term.type(b"exit 0\r")
    await term.expect("SHELL exited 0")
    assert await term.exit_status() == 0


@pytest.mark.needs_bwrap
async def test_library_attach_refuses_bad_detach_keys_before_starting(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxError, match="invalid detach keys"):
        await sandbox.attach("sh", detach_keys="ctrl-")
    assert sandbox.sessions() == []
    r, w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(SandboxError, match="session"):
            await sandbox.reattach("no-such-session", stdin=r)
        with pytest.raises(SandboxError, match="/dev/null"):
            await sandbox.attach_shell(stdin=null)
    finally:
        for fd in (r, w, null):
            os.close(fd)
    assert sandbox.sessions() == []
