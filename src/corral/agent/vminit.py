"""PID 1 of a microVM: preload, the snapshot point, the box's mounts, switch root, the clock.

``/init`` in the initramfs execs ``agent.py --vm-init PORT``; :func:`vm_init` does what an
init would, then returns the agent's config and the agent serves as PID 1.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any

    from corral.agent import protocol
else:
    import protocol


VM_PRELOAD = (
    # the agent's own modules, the loop first (agent.py imports it after this returns)
    "loop",
    "commands",
    "files",
    "info",
    "relays",
    "seccomp",
    "vmlink",
    # the standard modules they import on first use
    "ctypes",
    "errno",
    "fcntl",
    "json",
    "resource",
    "shutil",
    "struct",
    "subprocess",
    "termios",
    "threading",
)
"""Modules a microVM's agent imports before the snapshot point (the initramfs carries them):
everything it would otherwise import lazily, over 9p, on a restored VM's clock. A new module of
the agent imported anywhere but at the top of :mod:`loop` belongs here."""
MS_MOVE = 8192


def vm_init(port: str) -> dict[str, Any]:
    """PID 1 of a microVM, from the initramfs: import everything, tell the host it may save
    the VM, then mount the box (its script) and move into it. Returns the agent's config."""
    import ctypes
    import importlib
    import json
    import subprocess

    for name in VM_PRELOAD:
        importlib.import_module(name)
    fd = os.open(port, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    os.write(fd, protocol.VM_SNAPSHOT_MARKER)
    header = b""
    while not header.endswith(b"\n"):  # the VM may be saved and restored in this read
        chunk = os.read(fd, 1)
        if not chunk or len(header) > 32:
            raise SystemExit("corral-init: the host closed the channel before the box's script")
        header += chunk
    size, body = int(header), bytearray()
    while len(body) < size:
        chunk = os.read(fd, size - len(body))
        if not chunk:
            raise SystemExit("corral-init: the box's script was cut short")
        body += chunk
    received = uptime()
    os.close(fd)
    boot = json.loads(body)
    with open("/boot.sh", "w") as f:
        f.write(boot["script"])
    if subprocess.run(["/bin/sh", "-e", "/boot.sh"]).returncode != 0:
        raise SystemExit("corral-init: the box's mounts failed (see the console above)")
    check_masks(boot.get("checks", {}))
    set_clock(float(boot["clock"]), received)
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir("/newroot")  # switch_root, in this process: the box's root becomes /
    if libc.mount(b".", b"/", None, MS_MOVE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --move /newroot /")
    os.chroot(".")
    os.chdir("/")
    sys.path[0] = str(boot["agent_dir"])  # the agent's files inside the box, for later imports
    config: dict[str, Any] = boot["config"]
    return config


def check_masks(checks: dict[str, list[str]]) -> None:
    """Each mask inside a share a box can write must be a mount of its own at its path,
    reached from the box's root without following a link, unreadable (``hidden``) or
    read-only (``read_only``). The script mounted them by path over 9p: a box running on
    the same workspace could have swapped a link into a path meanwhile (the mask would
    then sit on the link's target, and the real path stay open once swapped back). The
    same check the host makes from ``/proc/PID/root`` on the other backends; here nothing
    of the box runs yet, so the guest's word is the host's. Fails the boot otherwise."""
    if not any(checks.values()):
        return
    if TYPE_CHECKING:
        from corral.agent import files
    else:
        import files
    opener = files._Openat2()
    root = os.open("/newroot", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for kind, dests in checks.items():
            for dest in dests:
                rel = dest.strip("/")
                try:
                    fd = opener.open(root, rel, os.O_PATH, 0, no_symlinks=True)
                except OSError as exc:
                    raise SystemExit(
                        f"{protocol.VM_REFUSED}the mask at {dest} cannot be reached without a link "
                        f"({exc.strerror}; swapped in by another box?): not started"
                    ) from None
                try:
                    parent = opener.open(root, os.path.dirname(rel) or ".", os.O_PATH, 0, True)
                    try:
                        ok = _mount_id(fd) != _mount_id(parent)
                    finally:
                        os.close(parent)
                    if kind == "hidden":
                        ok = ok and os.fstat(fd).st_mode & 0o777 == 0
                    else:
                        ok = ok and bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
                finally:
                    os.close(fd)
                if not ok:
                    raise SystemExit(
                        f"{protocol.VM_REFUSED}{dest} is not masked ({kind}) after the mounts (its "
                        "path changed while they were made?): not started"
                    )
    finally:
        os.close(root)


def _mount_id(fd: int) -> int:
    with open(f"/newroot/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise SystemExit("corral-init: no mnt_id in fdinfo")


def uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def set_clock(host_time: float, uptime_then: float) -> None:
    """Set the guest's clock from the host's, sent at ``uptime_then`` (a microVM restored from
    a snapshot wakes up with the snapshot's time). Before seccomp is installed: commands may
    not set the clock."""
    time.clock_settime(time.CLOCK_REALTIME, host_time + max(0.0, uptime() - uptime_then))
