"""Kernel quotas every box shares (issue 13, class 6): box A takes all it can of each, while
box B runs beside it, and B and the host must still get theirs.

inotify instances and watches and POSIX message queue bytes are charged to the host uid that
owns a box's user namespace: each box has its own (:mod:`corral.backends.host.ucounts`), so
A exhausts only its own share. Pipe buffers and epoll watches are charged to the host uid a
process runs as: each box's commands have their own (``users.command_id``). PTYs come from
the box's own devpts instance, capped at ``PTY_MAX``. Open files are capped per command
(``DEFAULT_NOFILE``, soft = hard). gVisor's inotify, queues and PTYs are its own kernel's:
those tests skip there. A microVM's are its guest kernel's: box A exhausts its own VM, and
the same tests check B and the host.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import ROOTLESS_RUN, rootless_skip
from corral import BackendError, Policy, PolicyError, Sandbox
from corral.backends.host import devpts
from corral.backends.host.state import state_root
from corral.backends.layout import PTY_MAX
from corral.backends.limits import DEFAULT_NOFILE
from corral.processes import Process
from security.helpers import box_py, gvisor

pytestmark = [pytest.mark.attack("processes"), pytest.mark.needs_bwrap]

libc = ctypes.CDLL(None, use_errno=True)


def _per_user(what: str) -> str:
    """Why a per-box kernel pool test does not apply rootless."""
    return (
        "rootless boxes get no host uids of their own (per-box owner and command uids need "
        f"root): {what} are counted against the user, shared by the user's boxes, not per "
        "box; other users and root keep theirs (SECURITY.md, Rootless, kernel pools)"
    )


@pytest.fixture
async def other_box(box_policy: Policy, tmp_path: Path) -> AsyncIterator[Sandbox]:
    """Box B, running for the whole attack of box A."""
    ws = tmp_path / "other"
    ws.mkdir()
    async with Sandbox(box_policy, workspace=ws) as sb:
        yield sb


def host_kernel_only(sb: Sandbox) -> None:
    if gvisor(sb):
        pytest.skip("gVisor's inotify, message queues and PTYs are its own kernel's")


async def hold(sb: Sandbox, code: str, *args: str) -> tuple[Process, str]:
    """Start ``code`` in the box; it prints one line once it holds what it took, then keeps
    it until stdin closes. Returns the process and that line."""
    proc = await sb.spawn(["python3", "-c", code, *args], stdin="pipe")
    queue = proc.subscribe()
    # What arrived with the spawn's reply (the same read of the channel) is in the buffer
    # only: no await lies between these two lines, so nothing is missed or counted twice.
    line = proc.output_bytes()
    async with asyncio.timeout(120):
        while not line.endswith(b"\n"):
            kind, data = await queue.get()
            assert kind == "stdout", (kind, data)
            assert isinstance(data, bytes)
            line += data
    return proc, line.decode().strip()


def host_watch(*, watch: bool = True) -> bool:
    """Whether host root still gets an inotify instance (and a watch). In a thread: closing
    an inotify descriptor waits for an SRCU grace period."""
    fd = libc.inotify_init1(0)
    if fd < 0:
        return False
    try:
        return not watch or libc.inotify_add_watch(fd, b"/tmp", 2) >= 0
    finally:
        os.close(fd)


INOTIFY_INSTANCES = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), ctypes.get_errno(), flush=True)
sys.stdin.read()
"""
INOTIFY_ONE = "import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)"


@rootless_skip(_per_user("inotify instances"))
async def test_inotify_instances_of_one_box_leave_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    host_kernel_only(sandbox)
    proc, line = await hold(sandbox, INOTIFY_INSTANCES)
    try:
        count, errno_ = map(int, line.split())
        assert count >= 1 and errno_ == 24, line  # EMFILE: its own owner's instances are gone
        r = await other_box.run(["python3", "-c", INOTIFY_ONE], timeout=30)
        assert r.stdout == "True\n", r
        assert await asyncio.to_thread(host_watch, watch=False), "host root lost inotify"
    finally:
        await proc.kill()


INOTIFY_WATCHES = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
limit = int(sys.argv[1])
files = limit // 100 + 2
os.makedirs('/tmp/w', exist_ok=True)
paths = []
for i in range(files):
    p = f'/tmp/w/{i}'
    open(p, 'w').close()
    paths.append(p.encode())
n = err = 0
while not err:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    for p in paths:
        if libc.inotify_add_watch(fd, p, 2) < 0:
            err = ctypes.get_errno()
            break
        n += 1
print(n, err, flush=True)
sys.stdin.read()
"""
WATCH_ONE = (
    "import ctypes; c = ctypes.CDLL(None); fd = c.inotify_init1(0); "
    "print(fd >= 0 and c.inotify_add_watch(fd, b'/tmp', 2) >= 0)"
)


@rootless_skip(_per_user("inotify watches"))
async def test_inotify_watches_of_one_box_leave_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    host_kernel_only(sandbox)
    limit = int(Path("/proc/sys/fs/inotify/max_user_watches").read_text())
    if limit > 2_000_000:
        pytest.skip(f"fs.inotify.max_user_watches is {limit}: too many to take in a test")
    proc, line = await hold(sandbox, INOTIFY_WATCHES, str(limit))
    try:
        count, errno_ = map(int, line.split())
        # ENOSPC once the owner's watches are gone (EMFILE: its instances ran out first)
        assert errno_ in (28, 24) and count <= limit, line
        r = await other_box.run(["python3", "-c", WATCH_ONE], timeout=30)
        assert r.stdout == "True\n", r
        assert await asyncio.to_thread(host_watch), "host root lost its inotify watches"
    finally:
        await proc.kill()


MQ_FILL = r"""
import ctypes, errno, os, sys
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
"""


async def test_message_queues_of_one_box_leave_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    host_kernel_only(sandbox)
    # Box A fills what it may, in two commands (the quota is the box's, not a command's).
    for tag in ("a1", "a2"):
        r = await sandbox.run(["python3", "-c", MQ_FILL, tag], timeout=30)
        assert r.exit_code == 0, r
    filled = int(r.stdout.split()[0])
    assert filled == 0, r.stdout  # the first command took the whole per-box quota
    r = await other_box.run(["python3", "-c", MQ_FILL, "b"], timeout=30)
    assert r.exit_code == 0 and int(r.stdout.split()[0]) >= 1, r
    name = f"/corral-host-{os.getpid()}".encode()
    fd = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    os.close(fd)
    libc.mq_unlink(name)


PIPE_FILL = r"""
import fcntl, os, sys
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
held, refused = [], 0
while len(held) < 450:
    r, w = os.pipe()
    held.append((r, w))
    if fcntl.fcntl(w, F_GETPIPE_SZ) < 65536:
        break  # the uid is past fs.pipe-user-pages-soft: new pipes get the minimum
    if not refused:  # 1 MiB pipes up to the limit, then default ones past it
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
        except PermissionError:
            refused = 1
print(len(held), fcntl.fcntl(held[-1][1], F_GETPIPE_SZ), refused, flush=True)
sys.stdin.read()
"""

PIPE_SIZE = "import fcntl, os; print(fcntl.fcntl(os.pipe()[1], 1032))"


@rootless_skip(_per_user("pipe buffer pages"))
async def test_pipe_buffers_of_one_box_leave_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    """Pipe buffer pages are counted per host uid of the process: box A's commands holding
    ``fs.pipe-user-pages-soft`` of them (64 MiB) would leave every box sharing their uid
    minimal pipes (one or two pages). Each box's commands have a host uid of their own
    (users.command_id)."""
    host_kernel_only(sandbox)
    soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
    if not 0 < soft <= 65536:
        pytest.skip(f"fs.pipe-user-pages-soft is {soft}: no soft limit to reach in a test")
    proc, line = await hold(sandbox, PIPE_FILL)
    try:
        _, last_size, _ = map(int, line.split())
        assert last_size < 65536, line  # box A did reach its uid's limit (refused or not)
        r = await sandbox.run(["python3", "-c", PIPE_SIZE], timeout=30)
        assert int(r.stdout) < 65536, r  # and its next pipe is a minimal one (1-2 pages)
        r = await other_box.run(["python3", "-c", PIPE_SIZE], timeout=30)
        assert r.stdout == "65536\n", (r, line)  # box B's pipes are whole
    finally:
        await proc.kill()


async def test_pty_pool_exhaustion_stays_in_the_box(sandbox: Sandbox, other_box: Sandbox) -> None:
    host_kernel_only(sandbox)
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
    if sandbox.policy.backend != "microvm":  # a VM's PTYs are its own kernel's pool
        assert count <= PTY_MAX, (count, why)
    r = await other_box.run(["python3", "-c", "import os; os.openpty(); print('ok')"])
    assert r.stdout == "ok\n", r
    master, slave = os.openpty()  # the host too
    os.close(master)
    os.close(slave)


def test_every_running_box_at_its_pty_cap_fits_in_the_kernels_pool() -> None:
    """Box A's cap holds A; the caps of all boxes that may run at once must fit in the
    shared pool, or A and its neighbours together could leave box B none. A start on a
    slot beyond that is refused, naming the sysctl that makes room."""
    pty_max, reserve = devpts.pool()
    fit = devpts.boxes_in_pool()
    assert fit * PTY_MAX <= pty_max - reserve < (fit + 1) * PTY_MAX
    assert fit >= 32, "realistic box counts must fit (48 with the kernel's defaults)"
    devpts.refuse_beyond_pool(fit - 1)
    with pytest.raises(BackendError, match=rf"{fit} boxes run already.*kernel\.pty\.max="):
        devpts.refuse_beyond_pool(fit)


@rootless_skip(
    "a rootless box takes no owner slot, so no start is refused for the kernel's PTY pool; "
    "each box's devpts is still capped at 64 (the two tests beside this one run)"
)
async def test_a_start_the_pty_pool_cannot_hold_is_refused(
    box_policy: Policy, workspace: Path, other_box: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a pool too small for one more box (here: a host whose kernel.pty.max leaves
    less than PTY_MAX beside the reserve), the start fails with the sysctl to raise, and
    box B keeps working."""
    host_kernel_only(other_box)
    if box_policy.backend == "microvm":
        pytest.skip("a VM's PTYs are its own kernel's pool")
    monkeypatch.setattr(devpts, "pool", lambda: (1024 + PTY_MAX - 1, 1024))
    sb = Sandbox(box_policy, workspace=workspace)
    with pytest.raises(BackendError, match=r"PTY pool.*sysctl -w kernel\.pty\.max="):
        await sb.start()
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()  # nothing of it is left
    r = await other_box.run(["python3", "-c", "import os; os.openpty(); print('ok')"])
    assert r.stdout == "ok\n", r


async def test_the_box_pty_pool_cannot_be_remounted_bigger(sandbox: Sandbox) -> None:
    host_kernel_only(sandbox)
    if sandbox.policy.backend == "microvm":
        pytest.skip("a VM's PTYs are its own kernel's pool")
    r = await sandbox.run(
        "grep ' /dev/pts ' /proc/self/mountinfo; "
        "mount -o remount,max=100000 /dev/pts 2>&1 || echo refused",
        timeout=30,
    )
    assert f"max={PTY_MAX}" in r.stdout and "refused" in r.stdout, r


OPEN_FILES = r"""
import os, resource, sys
fds = []
try:
    while len(fds) < 1 << 20:
        fds.append(os.open('/dev/null', os.O_RDONLY))
except OSError as e:
    err = e.strerror
print(len(fds), resource.getrlimit(resource.RLIMIT_NOFILE)[1], err, flush=True)
sys.stdin.read()
"""


async def test_open_files_are_capped_per_command_by_default(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    held = [await hold(sandbox, OPEN_FILES) for _ in range(8)]
    try:
        for _, line in held:
            count, hard, why = line.split(" ", 2)
            assert int(hard) == DEFAULT_NOFILE and int(count) < DEFAULT_NOFILE, line
            assert why == "Too many open files", line
        r = await sandbox.run(["sh", "-c", "ulimit -n 100000"], timeout=30)
        assert r.exit_code != 0, r  # no command raises the cap
        code = "import os; print(len([os.open('/dev/null', 0) for _ in range(500)]))"
        r = await other_box.run(["python3", "-c", code], timeout=30)
        assert r.stdout == "500\n", r
        fd = os.open("/dev/null", os.O_RDONLY)
        os.close(fd)
    finally:
        for proc, _ in held:
            await proc.kill()


async def test_a_capped_temporary_workspace_stops_a_filler(box_policy: Policy) -> None:
    """``workspace_size``/``workspace_inodes``: a temporary workspace is a tmpfs of that
    size, so filling it ends with ENOSPC there, not on the host's disk; it is gone at close."""
    fs = {"workspace_size": "4M", "workspace_inodes": 200, "tmp_size": "64M"}
    policy = Policy.from_dict({**box_policy.model_dump(exclude_unset=True), "filesystem": fs})
    if ROOTLESS_RUN:  # the capped tmpfs is host root's mount: refused, naming the fields
        with pytest.raises(BackendError, match=r"filesystem\.workspace_size/workspace_inodes"):
            async with Sandbox(policy):
                pass
        return
    async with Sandbox(policy) as sb:
        ws = sb.workspace
        assert ws is not None
        r = await sb.run("head -c 16M /dev/zero > big; ls -l big; df -k . | tail -1", timeout=30)
        assert "No space left on device" in r.stderr, r
        assert int(r.stdout.split()[4]) <= 4 << 20, r
        r = await sb.run("rm big; i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; echo $i")
        assert 0 < int(r.stdout) < 200, r
    assert not ws.exists()


async def test_a_cap_on_a_host_directory_is_refused_plainly(
    box_policy: Policy, workspace: Path
) -> None:
    fs = {"workspace_size": "1G"}
    policy = Policy.from_dict({**box_policy.model_dump(exclude_unset=True), "filesystem": fs})
    with pytest.raises(PolicyError, match="host directory, which corral cannot cap"):
        async with Sandbox(policy, workspace=workspace):
            pass


SYSV_FILL = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
counts = {}
for name, make in (("shm", lambda: libc.shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0o600)),
                   ("sem", lambda: libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600)),
                   ("msg", lambda: libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600))):
    n = 0
    while n < 40000 and make() >= 0:
        n += 1
    counts[name] = n
print(counts["shm"], counts["sem"], counts["msg"], flush=True)
sys.stdin.read()
"""
SYSV_ONE = (
    "import ctypes; c = ctypes.CDLL(None); "
    "print(min(c.shmget(0, 4096, 0o1600), c.semget(0, 1, 0o1600), c.msgget(0, 0o1600)) >= 0)"
)


async def test_sysv_ipc_of_one_box_leaves_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    """SysV shared memory, semaphores and message queues are counted per IPC namespace, and
    each box has its own: box A's identifiers run out, B's and the host's do not."""
    host_kernel_only(sandbox)
    proc, line = await hold(sandbox, SYSV_FILL)
    try:
        assert all(int(n) >= 1 for n in line.split()), line
        r = await other_box.run(["python3", "-c", SYSV_ONE], timeout=30)
        assert r.stdout == "True\n", r
        ids = [libc.shmget(0, 4096, 0o1600), libc.semget(0, 1, 0o1600), libc.msgget(0, 0o1600)]
        assert min(ids) >= 0, ids
        libc.shmctl(ids[0], 0, None)  # IPC_RMID: the host's own, removed at once
        libc.semctl(ids[1], 0, 0)
        libc.msgctl(ids[2], 0, None)
    finally:
        await proc.kill()


SIGQUEUE_FILL = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
class Val(ctypes.Union):
    _fields_ = [("i", ctypes.c_int), ("p", ctypes.c_void_p)]
n = 0
while n < 1 << 20 and libc.sigqueue(os.getpid(), signal.SIGRTMIN, Val(0)) == 0:
    n += 1
print(n, ctypes.get_errno(), flush=True)
sys.stdin.read()
"""
SIGQUEUE_ONE = (
    "import ctypes, os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN]); "
    "print(ctypes.CDLL(None).sigqueue(os.getpid(), signal.SIGRTMIN, 0) == 0)"
)


@rootless_skip(_per_user("queued signals"))
async def test_queued_signals_of_one_box_leave_the_others_theirs(
    sandbox: Sandbox, other_box: Sandbox
) -> None:
    """``RLIMIT_SIGPENDING`` is counted per user namespace owner up the chain, like message
    queues: box A fills its queue, B and the host still queue signals."""
    host_kernel_only(sandbox)
    proc, line = await hold(sandbox, SIGQUEUE_FILL)
    try:
        count, errno_ = map(int, line.split())
        assert count >= 1 and errno_ == 11, line  # EAGAIN: its own pending limit
        r = await other_box.run(["python3", "-c", SIGQUEUE_ONE], timeout=30)
        assert r.stdout == "True\n", r
    finally:
        await proc.kill()
