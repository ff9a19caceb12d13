"""Snapshots of booted microVMs: boot the kernel once per VM shape, restore it for every box.

A VM's /init loads its modules and starts the agent, which imports everything, tells the host
it reached the snapshot point (:data:`~corral.backends.microvm.initramfs.SNAPSHOT_MARKER`) and waits
for the box's payload on the channel. Nothing box-specific exists in the guest yet and no 9p
share is mounted (qemu refuses to migrate a VM with a mounted 9p export), so the state at that
point is the same for every box with the same devices, cpus and memory. The first VM of a
shape is saved there (``migrate`` to a file over QMP, about half a second) and killed; every
box, the first one too, starts qemu with ``-incoming`` from that file and skips the kernel's
boot entirely.

Restored VMs share the snapshot's memory, including the kernel's random pool: every VM has a
``vmgenid`` device, whose generation id changes on restore, and the kernel reseeds its random
generator on that change (Linux >= 5.18) before any box process exists. The guest clock is set
by the agent from the host's time, sent with the box's payload (``initramfs.boot_payload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.backends.host.state import cache_root
from corral.backends.host.threads import blocking
from corral.errors import BackendError

SAVE_TIMEOUT = 60.0
KEEP = 4
"""Saved VMs kept, most recently used first (each is 70-100 MiB: the guest's used memory)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """Everything a saved VM must share with the VM restored from it."""

    qemu: str
    image: str
    initrd: str
    accel: str
    machine: str
    cpus: int
    memory_mb: int
    shares: int
    devices: str
    """The device arguments without per-box paths, and the kernel command line."""

    def key(self) -> str:
        # The initramfs's name holds the fingerprint of its inputs, and its mtime is when it
        # was last used (the archive cache's order): not part of the key.
        stamps = [_stamp(self.qemu), _stamp(self.image), _stamp(self.initrd, mtime=False)]
        fields: dict[str, Any] = {
            "shape": [self.accel, self.machine, self.cpus, self.memory_mb, self.shares],
            "devices": self.devices,
            "files": stamps,
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def _stamp(path: str, *, mtime: bool = True) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{st.st_mtime_ns if mtime else ''}"


def snapshot_dir() -> Path:
    return cache_root() / "microvm" / "snapshots"


def snapshot_path(shape: Shape) -> Path:
    return snapshot_dir() / f"{shape.key()}.vm"


def incoming_args(fd: int) -> list[str]:
    """qemu arguments that restore the saved VM open at ``fd`` (it resumes running). A
    descriptor, not a path or ``exec:``: qemu runs jailed, spawns nothing and never opens
    the snapshot directory."""
    return ["-incoming", f"fd:{fd}"]


def _partial(dest: Path) -> Path:
    return dest.with_suffix(f".tmp{os.getpid()}")


def qmp_args(path: Path) -> list[str]:
    return ["-qmp", f"unix:{path},server=on,wait=off"]


def discard(path: Path) -> None:
    """Forget a snapshot that failed to restore (the next box saves a new one)."""
    path.unlink(missing_ok=True)


class Qmp:
    """A minimal QMP client: one command at a time, events kept for :meth:`wait_event`."""

    def __init__(
        self, sock: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._sock = sock
        self._reader = reader
        self._writer = writer
        self._events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: Path) -> Qmp:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, str(path))
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        except BaseException:
            sock.close()
            raise
        qmp = cls(sock, reader, writer)
        await qmp._read()  # the greeting
        await qmp.execute("qmp_capabilities")
        return qmp

    async def send_fd(self, name: str, fd: int) -> None:
        """Hand qemu ``fd`` as ``name`` (``getfd``, the descriptor sent with the command)."""
        await self._writer.drain()  # nothing of the stream may follow the descriptor's bytes
        request = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode()
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
        self._sock.sendmsg([request + b"\n"], rights)
        await self._reply("getfd")

    async def _read(self) -> dict[str, Any]:
        line = await self._reader.readline()
        if not line:
            raise BackendError("qemu closed its QMP monitor")
        message: dict[str, Any] = json.loads(line)
        return message

    async def execute(self, command: str, **arguments: Any) -> Any:
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        self._writer.write(json.dumps(request).encode() + b"\n")
        await self._writer.drain()
        return await self._reply(command)

    async def _reply(self, command: str) -> Any:
        while True:
            message = await self._read()
            if "event" in message:
                self._events.append(message)
            elif "error" in message:
                desc = message["error"].get("desc", message["error"])
                raise BackendError(f"qemu refused {command}: {desc}")
            elif "return" in message:
                return message["return"]

    async def wait_event(self, name: str, done: Any) -> dict[str, Any]:
        """The first event ``name`` whose data satisfies ``done(data)``."""
        while True:
            while self._events:
                event = self._events.pop(0)
                data: dict[str, Any] = event.get("data", {})
                if event["event"] == name and done(data):
                    return data
            self._events.append(await self._read())

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


async def save(qmp_socket: Path, dest: Path, timeout: float = SAVE_TIMEOUT) -> None:
    """Save the running VM to ``dest`` (atomic: a partial file never has the final name);
    the VM is left paused. Raises BackendError when qemu cannot migrate (the VM runs on).

    qemu writes to a descriptor of the partial file sent over QMP: it runs jailed, spawns
    nothing (no ``exec:``) and never opens the snapshot directory."""
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = _partial(dest)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        qmp = await Qmp.connect(qmp_socket)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        async with asyncio.timeout(timeout):
            caps = [{"capability": "events", "state": True}]
            await qmp.execute("migrate-set-capabilities", capabilities=caps)
            await qmp.send_fd("snapshot", fd)
            os.close(fd)
            fd = -1
            await qmp.execute("migrate", uri="fd:snapshot")
            final = await qmp.wait_event(
                "MIGRATION", lambda d: d.get("status") in ("completed", "failed", "cancelled")
            )
            if final["status"] != "completed":
                raise BackendError(f"qemu could not save the VM (migration {final['status']})")
    except TimeoutError:
        tmp.unlink(missing_ok=True)
        raise BackendError(f"saving the VM took longer than {timeout:g} s") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        await qmp.close()
    # Off the loop: pruning unlinks saved VMs of 70-100 MiB each (30 ms and more here).
    await blocking(_commit, tmp, dest)


def _commit(tmp: Path, dest: Path) -> None:
    tmp.replace(dest)
    prune(dest.parent)


def last_used(path: Path) -> float:
    """When a cached file was last used (its mtime, touched on use); 0 if it is gone, as when
    another corral process pruned it a moment ago."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def prune(directory: Path, keep: int = KEEP) -> None:
    """Keep the ``keep`` most recently used snapshots (a restore touches its file); stale
    ones, whose inputs changed, are never used again and go first. Also removes the partial
    files of savers that died."""
    snaps = sorted(directory.glob("*.vm"), key=last_used, reverse=True)
    for old in snaps[keep:]:
        old.unlink(missing_ok=True)
    for tmp in directory.glob("*.tmp*"):
        with contextlib.suppress(OSError, ValueError):
            if not Path(f"/proc/{int(tmp.suffix.removeprefix('.tmp'))}").exists():
                tmp.unlink()


def touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def remove_all() -> None:
    shutil.rmtree(snapshot_dir(), ignore_errors=True)
