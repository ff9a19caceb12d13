"""The backend protocol: start a box that runs the guest agent, and tear it down completely.

A backend knows nothing about processes, PTYs or files: all of that goes through the guest
agent over the channel socket a backend hands back. This is what lets the OCI and microVM
backends reuse every feature: they only need to start ``agent.py`` with the channel on a
known fd (or a virtio-serial port bridged to a socket).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from corral.policy import Policy

AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"
"""Host directory holding the guest agent (stdlib-only Python files)."""

BOX_PREFIX = "cb-"
"""Every box id starts with this; orphan sweeps touch nothing else."""

BOX_UID = 1000
"""uid (and gid) that commands run as inside every box; the agent is uid 0 of the box."""


def state_root() -> Path:
    """Where every backend keeps per-box state (``boxes/<id>``) for the orphan sweep."""
    return Path(os.environ.get("CORRAL_STATE_DIR", "/run/corral"))


@dataclass(frozen=True, slots=True)
class BoxSpec:
    """What to start: the policy, where the workspace is, and a unique id."""

    policy: Policy
    workspace: Path
    sandbox_id: str
    state_dir: Path


@dataclass(frozen=True, slots=True)
class BoxStats:
    """Resource accounting of a whole box, from its cgroup (None where not measured)."""

    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    oom_kills: int = 0
    pids: int | None = None
    pids_limit_hits: int = 0
    cpu_seconds: float | None = None


class Box(Protocol):
    """A started box. ``channel`` is the host end of the socket the agent speaks on."""

    @property
    def channel(self) -> socket.socket: ...

    @property
    def warnings(self) -> tuple[str, ...]:
        """Limits the host could not enforce (for example a missing cgroup controller)."""
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
