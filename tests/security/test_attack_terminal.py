"""Terminal attacks: pushing keystrokes into the session's input (TIOCSTI, TIOCLINUX), and
escape sequences aimed at whoever reads the session (stripped when asked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PROMPT
from corral import Sandbox
from corral.sessions.pty import PtySession

pytestmark = [pytest.mark.attack("terminal"), pytest.mark.needs_bwrap]

INJECT = (
    "import errno, fcntl, os, sys\n"
    "cmd = int(sys.argv[1], 0)\n"
    "codes = []\n"
    "for ch in 'touch /workspace/injected\\n':\n"
    "    try:\n"
    "        fcntl.ioctl(0, cmd, ch.encode())\n"
    "        codes.append('OK')\n"
    "    except OSError as e:\n"
    "        codes.append(errno.errorcode[e.errno])\n"
    "print('RESULT', sorted(set(codes)))\n"
)


async def _inject(sh: PtySession, workspace: Path, cmd: int) -> str:
    (workspace / "inject.py").write_text(INJECT)
    await sh.write(f"python3 inject.py {cmd:#x}; echo DO''NE\n")
    done = await sh.expect(r"RESULT (\[.*\])[\s\S]*DONE", 10)
    assert done.matched, sh.read()
    # Had a character been pushed, the shell would now read and run the injected line.
    await sh.write("echo EM''PTY\n")
    assert (await sh.expect("EMPTY", 10)).matched
    assert not (workspace / "injected").exists(), "a command was typed into the session"
    return done.captures[1]


@pytest.mark.parametrize(
    "cmd",
    [0x5412, 0x1_0000_5412, 0xFFFF_FFFF_0000_5412],
    ids=["TIOCSTI", "TIOCSTI-high-bits", "TIOCSTI-all-high-bits"],
)
async def test_tiocsti_injection_into_the_session(
    sh: PtySession, workspace: Path, cmd: int
) -> None:
    assert await _inject(sh, workspace, cmd) == "['EPERM']"


async def test_tioclinux_paste_into_the_session(sh: PtySession, workspace: Path) -> None:
    # TIOCLINUX subcode 2 (set selection) / 3 (paste): the first byte is the subcode.
    (workspace / "linux.py").write_text(
        "import errno, fcntl\n"
        "try:\n"
        "    fcntl.ioctl(0, 0x541C, bytes([3]))\n"
        "    print('RES''ULT OK')\n"
        "except OSError as e:\n"
        "    print('RES''ULT', errno.errorcode[e.errno])\n"
    )
    await sh.write("python3 linux.py\n")
    m = await sh.expect(r"RESULT (\w+)", 10)
    assert m.matched and m.captures[1] == "EPERM", sh.read()


async def test_tiocsti_through_dev_tty_without_a_session(sandbox: Sandbox) -> None:
    code = (
        "import errno, fcntl, os\n"
        "try:\n"
        "    fd = os.open('/dev/tty', os.O_RDWR)\n"
        "    fcntl.ioctl(fd, 0x5412, b'x'); print('OK')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
    )
    r = await sandbox.run(["python3", "-c", code])
    # no controlling terminal, or seccomp (gVisor: EIO, no terminal either)
    assert r.stdout.strip() in ("ENXIO", "EPERM", "EIO")


async def test_escape_sequences_are_stripped_for_the_reader(
    sandbox: Sandbox, workspace: Path
) -> None:
    """OSC 52 (clipboard), title set, DCS, C1 CSI (8-bit and UTF-8) and a split sequence must
    not reach a reader that asked for plain text."""
    (workspace / "esc.sh").write_text(
        "printf '\\033]52;c;ZXZpbA==\\007\\033]0;pwned\\007\\033P+q544e\\033\\\\'\n"
        "printf '\\302\\23331mred\\033[?25'\n"
        "printf 'l\\033[2J\\n'\n"
    )
    session = await sandbox.shell(strip_ansi=True)
    try:
        assert (await session.expect(PROMPT, 10)).matched
        await session.write("sh esc.sh; echo EN''D\n")
        m = await session.expect("END", 10)
        assert m.matched and "red" in m.output  # the script ran
        text = m.output + session.read()
        for bad in ("\x1b", "\x9b", "\x07", "ZXZpbA", "pwned", "544e"):
            assert bad not in text, (bad, text)
    finally:
        await session.close()
