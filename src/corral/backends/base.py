"""The backend protocol: start a box that runs the guest agent, and tear it down completely.

A backend knows nothing about processes, PTYs or files: all of that goes through the guest
agent over the channel socket a backend hands back. This is what lets the OCI and microVM
backends reuse every feature: they only need to start ``agent.py`` with the channel on a
known fd (or a virtio-serial port bridged to a socket).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from corral.policy import Policy

if TYPE_CHECKING:
    from corral.backends.host.cgroups import Cgroup
    from corral.net import BoxNetwork

AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"
"""Host directory holding the guest agent (stdlib-only Python files)."""


def kill_child(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL a child started with asyncio, through a pidfd, without reaping it.

    ``Process.kill()`` polls first (``Popen.send_signal``), which reaps a child that has just
    exited behind asyncio's watcher ("Unknown child process pid N" warnings)."""
    if proc.returncode is not None:
        return
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return  # already reaped: nothing to kill
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class BoxSpec:
    """What to start: the policy, where the workspace is, and a unique id."""

    policy: Policy
    workspace: Path
    sandbox_id: str
    state_dir: Path
    network: BoxNetwork | None = None
    """The host side of the network policy (None for ``none``): binds, forwarders, attach."""
    workspace_prepared: bool = False
    """The workspace is a staging directory whose content is bound in later (the warm pool):
    bind it as it is, and map the box user as for an idmapped workspace."""


@dataclass(frozen=True, slots=True)
class BoxStats:
    """Resource accounting of a whole box, from its cgroup (None where not measured)."""

    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    oom_kills: int = 0
    pids: int | None = None
    pids_limit_hits: int = 0
    cpu_seconds: float | None = None


class BoxBase:
    """What every backend's box holds: its spec, the host end of the channel, its warnings."""

    heartbeat_timeout = 30.0
    """Seconds the agent may take to answer a heartbeat before the box is declared hung."""

    def __init__(self, spec: BoxSpec, channel: socket.socket, warnings: tuple[str, ...]) -> None:
        self._spec = spec
        self._channel = channel
        self._warnings = warnings
        self._closed = False

    @property
    def channel(self) -> socket.socket:
        return self._channel

    @property
    def warnings(self) -> tuple[str, ...]:
        """Limits the host could not enforce (for example a missing cgroup controller)."""
        return self._warnings


class CgroupAccounting:
    """``stats()``, ``oom_kills()`` and ``pids_limit_hits()`` of a box from its cgroup."""

    _cgroup: Cgroup | None

    def oom_kills(self) -> int:
        return self._cgroup.oom_kills() if self._cgroup is not None else 0

    def pids_limit_hits(self) -> int:
        return self._cgroup.pids_limit_hits() if self._cgroup is not None else 0

    def stats(self) -> BoxStats:
        if self._cgroup is None:
            return BoxStats()
        s = self._cgroup.stats()
        cpu = None if s.cpu_usage_ns is None else s.cpu_usage_ns / 1e9
        return BoxStats(
            memory_bytes=s.memory_current,
            memory_peak_bytes=s.memory_peak,
            oom_kills=s.oom_kills,
            pids=s.pids_current,
            pids_limit_hits=s.pids_limit_hits,
            cpu_seconds=cpu,
        )


class Box(Protocol):
    """A started box. ``channel`` is the host end of the socket the agent speaks on."""

    @property
    def channel(self) -> socket.socket: ...

    @property
    def warnings(self) -> tuple[str, ...]:
        """Limits the host could not enforce (for example a missing cgroup controller)."""
        ...

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds the agent may take to answer a heartbeat before the box is declared hung
        (killed, and every call reports it)."""
        ...

    def stats(self) -> BoxStats: ...

    def oom_kills(self) -> int:
        """``stats().oom_kills`` alone, cheaply: read before and after every command."""
        ...

    def describe(self) -> dict[str, Any]:
        """Backend-specific facts for ``info()`` (backend name, isolation, limits)."""
        ...

    async def diagnose(self) -> str:
        """Why the box failed to start (the runtime's own error output), or ""."""
        ...

    async def close(self) -> None:
        """Kill everything in the box and remove every trace of it. Idempotent."""
        ...


class Backend(Protocol):
    name: str

    @classmethod
    def for_policy(cls, policy: Policy) -> Backend:
        """A backend configured for ``policy`` (BackendUnavailable when it cannot run here)."""
        ...

    async def start(self, spec: BoxSpec) -> Box:
        """Start a box whose guest agent is connected to ``Box.channel``."""
        ...
