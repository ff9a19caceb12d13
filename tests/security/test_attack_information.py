"""What a box need not see, and kernel pools every box shares (issue 13, classes 6 and 9):
bwrap's command line (host paths, the mask list) in ``/proc/1/cmdline``, the host's cgroupfs
listing other boxes, and the PTY pool one box could drain for all."""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.backends.layout import PTY_MAX
from security.helpers import box_py, gvisor

pytestmark = [pytest.mark.attack("processes"), pytest.mark.needs_bwrap]


@pytest.fixture
async def other_box(box_policy: Policy, tmp_path: Path) -> AsyncIterator[Sandbox]:
    ws = tmp_path / "other"
    ws.mkdir()
    async with Sandbox(box_policy, workspace=ws) as sb:
        yield sb


async def test_command_lines_hide_host_paths_and_masks(sandbox: Sandbox, workspace: Path) -> None:
    res_code = (
        "res = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try:\n"
        "            res[p] = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
        "        except OSError:\n"
        "            pass\n"
    )
    lines = await box_py(sandbox, res_code)
    assert lines, "no process visible at all"
    joined = "\n".join(lines.values())
    assert str(workspace) not in joined
    for option in ("--ro-bind", "--bind", "--tmpfs", "--seccomp", "/etc/shadow"):
        assert option not in joined, (option, lines)


async def test_cgroupfs_shows_no_other_box(sandbox: Sandbox, other_box: Sandbox) -> None:
    code = (
        "res = []\n"
        "for root, dirs, files in os.walk('/sys/fs/cgroup'):\n"
        "    res += [os.path.join(root, d) for d in dirs]\n"
    )
    seen = await box_py(sandbox, code, timeout=60)
    leaks = [p for p in seen if other_box.sandbox_id in p or "/corral" in p]
    assert not leaks, leaks[:5]


async def test_pty_pool_exhaustion_stays_in_the_box(sandbox: Sandbox, other_box: Sandbox) -> None:
    if gvisor(sandbox):
        pytest.skip("gVisor's PTYs are its own kernel's")
    code = (
        "fds = []\n"
        "try:\n"
        "    while len(fds) < 8000:\n"
        "        fds += os.openpty()\n"
        "except OSError as e:\n"
        "    err = e.strerror\n"
        "res = [len(fds) // 2, err]\n"
    )
    count, why = await box_py(sandbox, code, timeout=60)
    assert count <= PTY_MAX, (count, why)
    r = await other_box.run(["python3", "-c", "import os; os.openpty(); print('ok')"])
    assert r.stdout == "ok\n", r
    master, slave = os.openpty()  # the host too
    os.close(master)
    os.close(slave)


MQ_FILL = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long),
                ("msgsize", ctypes.c_long), ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]
n = err = 0
while n < 200:
    attr = Attr(0, 10, 8192, 0)
    name = f"/corral-{sys.argv[1]}-{n}".encode()
    fd = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr))
    if fd < 0:
        err = ctypes.get_errno()
        break
    n += 1
print(n, errno.errorcode.get(err, err) if err else "")
""".replace("import ctypes, os, sys", "import ctypes, errno, os, sys")


async def test_message_queue_exhaustion_stays_in_the_box(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    if gvisor(sandbox):
        pytest.skip("gVisor's message queues are its own kernel's")
    # Box A fills what it may, in two commands (the quota is the box's, not a command's).
    for tag in ("a1", "a2"):
        r = await sandbox.run(["python3", "-c", MQ_FILL, tag], timeout=30)
        assert r.exit_code == 0, r
    filled = int(r.stdout.split()[0])
    assert filled == 0, r.stdout  # the first command took the whole per-box quota
    r = await other_box.run(["python3", "-c", MQ_FILL, "b"], timeout=30)
    assert r.exit_code == 0 and int(r.stdout.split()[0]) >= 1, r
    libc = ctypes.CDLL(None, use_errno=True)
    name = f"/corral-host-{os.getpid()}".encode()
    fd = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    os.close(fd)
    libc.mq_unlink(name)


INOTIFY_HOLD = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), flush=True)
sys.stdin.read()
"""
INOTIFY_ONE = "import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)"


async def test_inotify_exhaustion_stays_in_the_box(sandbox: Sandbox, other_box: Sandbox) -> None:
    if gvisor(sandbox):
        pytest.skip("gVisor's inotify is its own kernel's")
    # A guard, measured on the 6.18 kernel here: box A stops at fs.inotify.max_user_instances
    # (128) while box B and host root still get theirs. Kernels that charge the namespace
    # owner's host uid instead would fail this (see SECURITY.md).
    hold = await sandbox.spawn(["python3", "-c", INOTIFY_HOLD], stdin="")
    queue = hold.subscribe()
    try:
        kind, data = await asyncio.wait_for(queue.get(), 30)
        assert kind == "stdout", (kind, data)
        r = await other_box.run(["python3", "-c", INOTIFY_ONE], timeout=30)
        host_fd = ctypes.CDLL(None).inotify_init1(0)
        if host_fd >= 0:
            os.close(host_fd)
        assert r.stdout == "True\n" and host_fd >= 0, (r, host_fd)
    finally:
        await hold.kill()
