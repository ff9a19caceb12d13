"""The floor of a cold bwrap box's create-to-ready on this machine: what is left when the
host's own work is taken away.

    python bench/start_floor.py [--runs N] [--prep-ms MS]        (root)

Issue 12 asks for create-to-ready of a cold box <= 25 ms. ``bench/start_timeline.py`` shows
where a start goes (the host's steps, bwrap's namespaces and mounts, the guest agent's
interpreter); this tool measures, in one run, medians (and minimums) of:

- ``raw bwrap``: ``bwrap --ro-bind / / true``, the issue's baseline.
- ``box's bwrap, true``: bwrap with the options a default box gets (taken from a real start;
  its descriptors replaced by plain paths) running ``/usr/bin/true``.
- ``box's bwrap, agent``: that bwrap running the agent's interpreter through the modules the
  agent imports before it says ready, "ready" when it writes to a pipe. The floor of today's
  design: no host step at all (no cgroup, id map, devpts, seccomp, channel).
- ``joined agent``: the overlap a pre-started agent would buy. The agent's interpreter is
  started first, outside the box, while bwrap builds the box; once bwrap's command runs, the
  interpreter enters the box's namespaces (``setns``), its root, and forks into its pid
  namespace, and that child is "ready". Without the work a real one would need on top
  (capabilities, seccomp, no_new_privs, the cgroup), and with a shell as bwrap's command to
  say when the mounts are done. Measured with no host step, and after ``--prep-ms`` of host
  CPU before bwrap (today's host steps before bwrap's exec, ~7 ms here): on a two-core
  machine the agent's interpreter and the host's work share the cores.
- ``Sandbox().start()``: today's create-to-ready.

A developer's tool, like ``bench/start_timeline.py``; it prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from corral import Sandbox
from corral.backends.base import AGENT_DIR
from corral.backends.bwrap import box as bwrap_box
from corral.backends.host.python import find_python
from corral.backends.layout import GUEST_AGENT_DIR

AGENT_IMPORTS = "import posix, sys; sys.path.insert(0, {dir!r}); import lean, protocol, loop"
_JOIN = """
import ctypes
posix.write(1, b"i")
pid = int(posix.read(0, 64))
libc = ctypes.CDLL(None, use_errno=True)
names = ("user", "mnt", "pid", "ipc", "uts", "net", "cgroup")
fds = [posix.open(f"/proc/{pid}/ns/{n}", posix.O_RDONLY) for n in names]
root = posix.open(f"/proc/{pid}/root", posix.O_RDONLY | posix.O_DIRECTORY)
for fd in fds:
    if libc.setns(fd, 0) != 0:
        posix._exit(3)
    posix.close(fd)
posix.fchdir(root)
posix.chroot(".")
if posix.fork() == 0:
    posix.write(1, b"r")
posix._exit(0)
"""


def box_options() -> list[str]:
    """The options bwrap gets for a default box (through ``--args``), from a real start."""
    got: list[bytes] = []
    real = bwrap_box.BwrapBackend._popen

    def spy(self: Any, argv: list[str], pass_fds: tuple[int, ...], uid: int) -> Any:
        got.append(os.pread(int(argv[argv.index("--args") + 1]), 1 << 20, 0))
        return real(self, argv, pass_fds, uid)

    async def one() -> None:
        async with Sandbox():
            pass

    bwrap_box.BwrapBackend._popen = spy  # type: ignore[method-assign]
    try:
        asyncio.run(one())
    finally:
        bwrap_box.BwrapBackend._popen = real  # type: ignore[method-assign]
    return [a.decode() for a in got[0].split(b"\0")[:-1]]


def standalone(options: list[str], workspace: str) -> list[str]:
    """``options`` without the descriptors the host would pass (waits, info, seccomp; the
    workspace and devpts mounts): what bwrap alone can run."""
    out: list[str] = []
    i = 0
    while i < len(options):
        opt = options[i]
        if opt in ("--userns-block-fd", "--info-fd", "--block-fd", "--seccomp"):
            i += 2
        elif opt == "--bind-fd":
            out += ["--bind", workspace, options[i + 2]]
            i += 3
        elif opt == "--dev-bind" and options[i + 2] == "/dev/pts":
            i += 3
        else:
            out.append(opt)
            i += 1
    return out


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def timed_run(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, env={"PATH": "/usr/bin:/bin"})
    return (time.perf_counter() - t0) * 1000


def serial_agent(bwrap: list[str], python: str) -> float:
    r, w = os.pipe()
    code = AGENT_IMPORTS.format(dir=GUEST_AGENT_DIR) + f"; posix.write({w}, b'r')"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [*bwrap, python, "-I", "-S", "-c", code], pass_fds=(w,), env={"PATH": "/usr/bin"}
    )
    os.close(w)
    ready = os.read(r, 1)
    t1 = time.perf_counter()
    os.close(r)
    proc.kill()
    proc.wait()
    assert ready == b"r", "the agent's interpreter did not start in the box"
    return (t1 - t0) * 1000


def joined_agent(bwrap: list[str], python: str, prep_ms: float) -> float:
    code = AGENT_IMPORTS.format(dir=str(AGENT_DIR)) + _JOIN
    t0 = time.perf_counter()
    agent = subprocess.Popen(
        [python, "-I", "-S", "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin"},
    )
    assert agent.stdin is not None and agent.stdout is not None
    busy(prep_ms)
    info_r, info_w = os.pipe()
    said_r, said_w = os.pipe()
    box = subprocess.Popen(
        [
            bwrap[0],
            "--info-fd",
            str(info_w),
            *bwrap[1:],
            "/bin/sh",
            "-c",
            f"printf x >&{said_w}; exec sleep 1000",
        ],
        pass_fds=(info_w, said_w),
        env={"PATH": "/usr/bin"},
    )
    os.close(info_w)
    os.close(said_w)
    info = b""
    while not info.rstrip().endswith(b"}"):
        info += os.read(info_r, 4096)
    os.close(info_r)
    assert os.read(agent.stdout.fileno(), 1) == b"i"
    assert os.read(said_r, 1) == b"x", "bwrap's command did not run"
    os.close(said_r)
    agent.stdin.write(str(json.loads(info)["child-pid"]).encode())
    agent.stdin.close()
    ready = agent.stdout.read()
    t1 = time.perf_counter()
    box.kill()
    box.wait()
    agent.wait()
    agent.stdout.close()
    assert ready == b"r", f"the agent did not enter the box: {ready!r}"
    return (t1 - t0) * 1000


def sandbox_starts(runs: int) -> list[float]:
    async def starts() -> list[float]:
        times = []
        for _ in range(runs):
            sb = Sandbox()
            t0 = time.perf_counter()
            await sb.start()
            times.append((time.perf_counter() - t0) * 1000)
            await sb.aclose()
        return times

    return asyncio.run(starts())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--prep-ms", type=float, default=7.0)
    args = parser.parse_args()
    bwrap = shutil.which("bwrap")
    if os.geteuid() != 0 or bwrap is None:
        sys.exit("start_floor: needs root and bwrap")
    python = find_python()
    with tempfile.TemporaryDirectory() as workspace:
        box = [bwrap, *standalone(box_options(), workspace)]
        rows: list[tuple[str, Callable[[], float]]] = [
            (
                "raw bwrap (--ro-bind / / true)",
                lambda: timed_run([bwrap, "--ro-bind", "/", "/", "true"]),
            ),
            ("box's bwrap, true", lambda: timed_run([*box, "/usr/bin/true"])),
            ("box's bwrap, agent (the floor)", lambda: serial_agent(box, python)),
            ("joined agent, no host step", lambda: joined_agent(box, python, 0.0)),
            (
                f"joined agent, {args.prep_ms:g} ms of host step",
                lambda: joined_agent(box, python, args.prep_ms),
            ),
        ]
        results = {name: [measure() for _ in range(args.runs)] for name, measure in rows}
    sandbox_starts(2)  # warm: the agent's .pyc, the first cgroup
    results["Sandbox().start() today"] = sandbox_starts(args.runs)
    raw = statistics.median(results[rows[0][0]])
    print(f"median (min) ms over {args.runs} runs; x = the median / raw bwrap's")
    for name, times in results.items():
        p50 = statistics.median(times)
        print(f"  {name:<40} {p50:6.1f} ({min(times):5.1f})  {p50 / raw:5.2f}x")


if __name__ == "__main__":
    main()
