"""A PTY pool of the box's own, capped (``max=``), for bwrap.

bwrap's ``--dev`` mounts a devpts instance without options, so a box could open PTYs until
the kernel's pool (``kernel.pty.max``, shared by every box and the host) ran dry. Instead,
while bwrap waits for its id maps, corral enters the box's new mount namespace and mounts a
devpts instance there with ``max=`` (:data:`~corral.backends.layout.PTY_MAX`) on
:func:`mount_point`, a directory every box shares on the host but which holds that mount in
the box's namespace only; bwrap then binds it over ``/dev/pts`` (``--dev-bind``). The mount
is made by host root, so the box's root can neither remount nor unmount it under ``/dev``.
The new namespace is owned by the box's less privileged user namespace, so the host's shared
mounts are slaves in it: nothing propagates back to the host, and nothing needs unmounting.

``max=`` bounds one box; the kernel's pool (``kernel.pty.max``) is one for every devpts
instance but the host's own, which alone may use the ``kernel.pty.reserve`` part. So that box
B always gets its PTYs however many its neighbours hold, the sum of the caps of the boxes
running at once must fit in ``kernel.pty.max - kernel.pty.reserve``:
:func:`refuse_beyond_pool` refuses a start (bwrap and runc/crun, as root) whose owner slot
lies beyond the number of boxes that fit. Slots are handed out lowest first, so a box on slot
``n`` starts while ``n`` others run.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from corral.backends.host import mounts
from corral.backends.host.state import state_root
from corral.backends.layout import PTY_MAX
from corral.errors import BackendError

OPTIONS = f"newinstance,ptmxmode=0666,mode=0620,max={PTY_MAX}"
"""The box's devpts: its own instance, ``/dev/ptmx`` usable by the box user, PTY_MAX PTYs."""
_CLONE_NEWNS = 0x00020000
_CLONE_FS = 0x00000200
_MS_NOSUID_NOEXEC = mounts.MS_NOSUID | 0x8

_thread: ThreadPoolExecutor | None = None
_host_ns = -1
_lock = threading.Lock()


def mount_point() -> Path:
    """The (empty) host directory each box's devpts is mounted on, in its own namespace."""
    path = state_root() / "devpts"
    if not path.is_dir():
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.chmod(0o755)  # bwrap, as the box's root, must reach it
    return path


def _own_fs_context() -> None:
    """A thread that shares its fs context with the process may not change mount
    namespaces: give the devpts thread its own."""
    if mounts.libc().unshare(_CLONE_FS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FS)")


def _mount(pid: int, target: str) -> None:
    libc = mounts.libc()
    box_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(box_ns, _CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns(the box's mount namespace)")
        try:
            done = libc.mount(
                b"devpts", target.encode(), b"devpts", _MS_NOSUID_NOEXEC, OPTIONS.encode()
            )
            if done != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mount devpts on {target}: {os.strerror(err)}")
        finally:
            if libc.setns(_host_ns, _CLONE_NEWNS) != 0:
                _retire()  # this thread must never mount anything again
                raise OSError(ctypes.get_errno(), "setns(back to the host's mount namespace)")
    finally:
        os.close(box_ns)


def _retire() -> None:
    global _thread
    with _lock:
        if _thread is not None:
            _thread.shutdown(wait=False)
        _thread = None


def mount_for(pid: int, target: Path) -> None:
    """Mount the box's devpts on ``target`` in the mount namespace of ``pid`` (bwrap's child,
    still waiting on ``--userns-block-fd``). Blocking: a few syscalls in a thread of its own,
    the only one that changes mount namespaces."""
    submit_mount(pid, target).result()


def submit_mount(pid: int, target: Path) -> Future[None]:
    """:func:`mount_for`, submitted to the devpts thread now (no other thread hop): the caller
    waits for the future (``asyncio.wrap_future``), also when it fails."""
    global _thread, _host_ns
    with _lock:
        if _host_ns < 0:
            _host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if _thread is None:
            _thread = ThreadPoolExecutor(
                1, thread_name_prefix="corral-devpts", initializer=_own_fs_context
            )
        thread = _thread
    return thread.submit(_mount, pid, str(target))


PTY_SYSCTLS = Path("/proc/sys/kernel/pty")


def pool() -> tuple[int, int]:
    """``(kernel.pty.max, kernel.pty.reserve)``: the system-wide count of PTYs, and the part
    of it only the host's own devpts instance may take."""
    return (
        int((PTY_SYSCTLS / "max").read_text()),
        int((PTY_SYSCTLS / "reserve").read_text()),
    )


def boxes_in_pool(size: tuple[int, int] | None = None) -> int:
    """How many boxes, each holding :data:`PTY_MAX` PTYs, fit in the pool beside the host's
    reserve (48 with the kernel's defaults)."""
    pty_max, reserve = pool() if size is None else size
    return max(0, pty_max - reserve) // PTY_MAX


def refuse_beyond_pool(slot: int, size: tuple[int, int] | None = None) -> None:
    """BackendError when a box on owner slot ``slot`` would not fit in the kernel's PTY
    pool beside the boxes on the slots below it (held: slots go lowest first), so box B
    could be starved by A's PTYs. Raising ``kernel.pty.max`` makes room at once."""
    pty_max, reserve = pool() if size is None else size
    fit = boxes_in_pool((pty_max, reserve))
    if slot < fit:
        return
    need = reserve + (slot + 1) * PTY_MAX
    raise BackendError(
        f"{slot} boxes run already and the kernel's PTY pool holds {fit} at {PTY_MAX} PTYs "
        f"each (kernel.pty.max {pty_max} less kernel.pty.reserve {reserve}, the host's own): "
        "another box could leave its neighbours without a terminal. Close a box, or raise "
        f"the pool: sysctl -w kernel.pty.max={need}"
    )
