"""What the guest agent loads to start and to start commands (its start is on every box's
create-to-ready), and commands.start, the spawn without ``subprocess``, as Popen behaves.

Each check runs in a fresh ``python3 -I -S`` with the agent's directory on its path, as the
box runs it (the modules import each other as siblings there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from corral.agent import lean

AGENT_DIR = os.path.dirname(lean.__file__)
HEAVY = (
    "os",
    "posixpath",
    "_collections_abc",
    "subprocess",
    "signal",
    "enum",
    "threading",
    "struct",
)


def agent_python(code: str) -> str:
    """Run ``code`` as the agent's interpreter would; its stdout (stderr on failure)."""
    prelude = f"import sys; sys.path.insert(0, {AGENT_DIR!r})\n"
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_agent_is_ready_without_os_or_subprocess() -> None:
    """Everything the agent does before it says "ready" (config, channel, poller, signals)
    leaves os's and subprocess's Python layers unloaded."""
    code = f"""
        import _socket, posix
        import lean
        a, b = _socket.socketpair()
        config = lean.loads(lean.dumps({{"fd": b.detach(), "uid": posix.getuid(),
                                          "gid": posix.getgid(), "landlock": {{"off": "t"}}}}))
        import loop
        loop.Agent(config)
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
    """
    assert agent_python(code) == "[]"


def test_commands_start_as_popen_without_importing_subprocess() -> None:
    code = """
        import json, posix
        import commands
        out = {}
        def read_all(fd):
            data = b""
            while chunk := posix.read(fd, 100):
                data += chunk
            return data.decode()
        uid, gid = posix.getuid(), posix.getgid()
        kw = dict(uid=uid, gid=gid, new_session=True, preexec=None,
                  stdin=commands.PIPE, stdout=commands.PIPE, stderr=commands.PIPE)
        p = commands.start(["sh", "-c", "cat; echo err >&2; pwd; exit 7"], cwd="/tmp",
                           env={"PATH": "/usr/bin:/bin"}, **kw)
        posix.write(p.stdin, b"in\\n"); posix.close(p.stdin)
        out["stdout"], out["stderr"] = read_all(p.stdout), read_all(p.stderr)
        out["status"] = posix.waitstatus_to_exitcode(posix.waitpid(p.pid, 0)[1])
        out["own_session"] = posix.getsid(0) != p.pid
        for argv, cwd in ((["no-such-program"], None), (["/no/such"], None), (["true"], "/nope")):
            try:
                commands.start(argv, cwd=cwd, env={"PATH": "/usr/bin:/bin"}, **kw)
            except OSError as exc:
                out[argv[0] + " " + str(cwd)] = [type(exc).__name__, exc.errno, exc.filename]
        out["loaded"] = [m for m in ("subprocess", "signal", "threading") if m in sys.modules]
        print(json.dumps(out))
    """
    out = json.loads(agent_python(code))
    assert out["stdout"] == "in\n/tmp\n" and out["stderr"] == "err\n"
    assert out["status"] == 7 and out["own_session"]
    assert out["no-such-program None"] == ["FileNotFoundError", 2, "no-such-program"]
    assert out["/no/such None"] == ["FileNotFoundError", 2, "/no/such"]
    assert out["true /nope"] == ["FileNotFoundError", 2, "/nope"]
    assert out["loaded"] == []
