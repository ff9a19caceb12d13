"""A backend's host-side child (bwrap; bwrap holding a jailed qemu): started by ``Popen``, its
exit seen through a pidfd, never through asyncio's child watcher.

``asyncio.create_subprocess_exec`` costs the event loop more than the spawn: it starts a
watcher thread per child (the loop waits until that thread runs: over 20 ms on a busy host),
sets up pipe transports over several loop turns, and a spawn that must fork (another user,
other groups) runs the fork on the loop. :func:`spawn` runs ``Popen`` in a host thread;
:class:`HostChild` waits for the exit on the loop through the child's pidfd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any, cast

from corral.backends.host.threads import blocking, submit

__all__ = ["HostChild", "adopt", "read_until", "spawn", "watch"]


class HostChild:
    """A child started by ``Popen`` (its stderr a pipe, or not kept), its exit seen through a
    pidfd. :meth:`close` releases the pidfd and the pipe once it has exited."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._pidfd = os.pidfd_open(popen.pid)
        self._exited: asyncio.Future[None] | None = None
        self._stderr = popen.stderr
        if self._stderr is not None:
            os.set_blocking(self._stderr.fileno(), False)

    @property
    def returncode(self) -> int | None:
        """The exit status once :meth:`wait` has seen the child exit, else None."""
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL the child (through its pidfd: never another process that got its pid)."""
        if self._popen.returncode is None and self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        """Wait for the child to exit and reap it (cancelling this wait leaves it waitable)."""
        if self._popen.returncode is None and self._pidfd >= 0:
            await asyncio.shield(self._exit())
            self._popen.poll()  # it has exited: reaps it without blocking
        return self._popen.returncode if self._popen.returncode is not None else -1

    def reap_on_exit(self) -> None:
        """Reap the child the moment it exits, with nobody waiting for it (a box whose
        agent died is otherwise a zombie of this process until it is closed). On the loop:
        the pidfd is one more reader, no task."""
        if self._popen.returncode is None and self._pidfd >= 0:
            self._exit()

    def _exit(self) -> asyncio.Future[None]:
        """The future of the child's exit, seen on the pidfd (which reaps it there)."""
        if self._exited is None:
            loop = asyncio.get_running_loop()
            self._exited = exited = loop.create_future()

            def on_exit() -> None:
                loop.remove_reader(self._pidfd)
                self._popen.poll()  # it has exited: reaps it without blocking
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(self._pidfd, on_exit)
        return self._exited

    async def stderr(self, limit: int = 8192) -> str:
        """What the child printed before it died (bwrap names the failing mount or option,
        qemu its error): up to ``limit`` bytes, waiting at most 2 s for the pipe to end."""
        if self._stderr is None:
            return ""
        got = bytearray()  # what came before the 2 s ran out counts too
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(2):
                await read_until(self._stderr.fileno(), lambda _: False, limit, got)
        return got.decode(errors="replace").strip()

    def close(self) -> None:
        """Release the pidfd and the stderr pipe (after :meth:`wait`)."""
        if self._pidfd >= 0:
            if self._exited is not None and not self._exited.done():
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(self._pidfd)
                self._exited.cancel()
            os.close(self._pidfd)
            self._pidfd = -1
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


async def read_until(
    fd: int, done: Callable[[bytearray], bool], limit: int, got: bytearray | None = None
) -> bytes:
    """Read the non-blocking ``fd`` on the event loop until ``done(what came)``, its end or
    ``limit`` bytes, into ``got`` as it comes (a caller whose timeout cuts the read keeps
    what arrived)."""
    loop = asyncio.get_running_loop()
    data = bytearray() if got is None else got
    while len(data) < limit and not done(data):
        try:
            chunk = os.read(fd, min(1 << 16, limit - len(data)))
        except BlockingIOError:
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            continue
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _popen(argv: list[str], popen: dict[str, Any]) -> subprocess.Popen[bytes]:
    return cast("subprocess.Popen[bytes]", subprocess.Popen(argv, **popen))


def watch(popen: subprocess.Popen[bytes]) -> HostChild:
    """``popen``, just started, as a :class:`HostChild`; killed and reaped if it cannot be
    watched (no pidfd: out of descriptors)."""
    try:
        return HostChild(popen)
    except BaseException:
        popen.kill()
        popen.wait()
        raise


async def adopt(started: concurrent.futures.Future[subprocess.Popen[bytes]]) -> HostChild:
    """The child a host thread is starting (``started``: its ``Popen``), watched. Cancelled
    meanwhile, that child is killed and reaped before the cancellation goes on; the thread's
    own error (an ``OSError`` of the spawn) reaches the caller."""
    try:
        child = await asyncio.shield(asyncio.wrap_future(started))
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            orphan = await asyncio.wrap_future(started)
            orphan.kill()
            await blocking(orphan.wait)
        raise
    return watch(child)


async def spawn(argv: list[str], **popen: Any) -> HostChild:
    """``Popen(argv, **popen)`` in a host thread, off the event loop (see :func:`adopt`)."""
    return await adopt(submit(_popen, argv, popen))
