"""The box model every backend shares: the complete :class:`Box` and :class:`Backend`
protocols, and :class:`BoxBase` / :class:`BackendBase` holding what all of them do alike.

A backend knows nothing about processes, PTYs or files: all of that goes through the guest
agent over the channel socket a backend hands back. This is what lets the OCI and microVM
backends reuse every feature: they only need to start the agent with the channel on a known
fd (or a virtio-serial port bridged to a socket).

What a backend adds is one folder (``bwrap/``, ``oci/``, ``microvm/``) with a ``box.py``
holding its ``Backend`` (registered in :mod:`corral.backends`) and its ``BoxBase`` subclass.
It builds on :mod:`.layout` (policy -> mounts), :mod:`.users` (uid maps) and :mod:`.host`
(cgroups, seccomp, idmapped mounts, state directories), never on another backend's folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from corral.backends.host import tempws
from corral.backends.host.child import HostChild, spawn
from corral.backends.host.state import orphaned_boxes, pid_alive, state_root
from corral.backends.host.threads import blocking
from corral.backends.layout import SYSTEM_PATH
from corral.backends.limits import agent_rlimits
from corral.backends.users import BOX_UID, COMMAND_HOST_ID, GUEST_HOME
from corral.errors import BackendError, BackendUnavailable
from corral.net import sweep as sweep_network
from corral.policy import Policy

if TYPE_CHECKING:
    from corral.backends.host.cgroups import Cgroup
    from corral.backends.limits import LimitPlan
    from corral.net import BoxNetwork


PAUSE_DEADLINE_S = 5.0
"""How long ``freeze(True)`` waits for every process of a box to stop (cgroup v1 freezes
asynchronously: a process in uninterruptible sleep holds the group in FREEZING)."""

AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"
"""Host directory holding the guest agent (stdlib-only Python files)."""


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
    ready_timeout: float | None = None
    """Seconds the caller gives the box to become ready (``Sandbox(ready_timeout=...)``); a
    backend with a boot wait of its own (the microVM's) uses it in place of its default."""
    user: Literal["user", "root"] = "user"
    """Who commands run as: box uid 1000, or box root (``policy.user``, or the image's
    ``User``, as :class:`corral.Sandbox` decided)."""


@dataclass(frozen=True, slots=True)
class RootLayer:
    """A box's writable root, as the host sees it: overlayfs's upper directory (what the box
    changed above its image; written by the box: read it as hostile) and the box's id map,
    ``(box id, host id, count)`` ranges, to tell the box ids of what it holds."""

    upper: Path
    ids: tuple[tuple[int, int, int], ...]
    mount_points: frozenset[str] = frozenset()
    """Paths (relative: ``workspace``, ``etc/resolv.conf``) the backend made in the root for
    the box's own mounts where the image had none: mount points, not changes of the box."""
    subvolume: Path | None = None
    """The copy-on-write subvolume holding the upper (its on-disk ids the box's own), which
    a snapshot takes in O(1); None where the upper is a tmpfs."""

    def box_id(self, host_id: int) -> int:
        """The box's id for ``host_id`` (65534, nobody, for an id the box does not map)."""
        for box, host, count in self.ids:
            if host <= host_id < host + count:
                return box + host_id - host
        return 65534


@dataclass(frozen=True, slots=True)
class BoxStats:
    """Resource accounting of a whole box, from its cgroup (None where not measured)."""

    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    oom_kills: int = 0
    pids: int | None = None
    pids_limit_hits: int = 0
    cpu_seconds: float | None = None


def agent_config(spec: BoxSpec, *, uid: int = BOX_UID, gid: int = BOX_UID) -> dict[str, Any]:
    """The part of the guest agent's start-up config every backend sends alike: who commands
    run as and what ``info`` reports. Each backend adds where its channel is (``fd`` or
    ``device``) and how the network's forwarders reach the host."""
    return {
        "uid": uid,
        "gid": gid,
        "home": GUEST_HOME,  # the agent makes it the user's where the backend did not
        "info": {"sandbox_id": spec.sandbox_id, "workdir": spec.policy.workdir},
        "rlimits": agent_rlimits(spec.policy.limits),
    }


def refuse_image(spec: BoxSpec, backend: str, why: str = "") -> None:
    """BackendUnavailable, naming the field, the cause (``why``) and the way out, for a box
    on an image (or whose commands run as box root) where ``backend`` has neither yet."""
    cause = f" ({why})" if why else ""
    if spec.policy.user == "root" or spec.user == "root":
        raise BackendUnavailable(
            f"policy.user 'root': the {backend} backend runs commands as the box user only "
            "for now; box root runs on the bwrap and oci (runc, crun) backends (as root)"
        )
    if spec.policy.image != "host":
        raise BackendUnavailable(
            f"policy.image {spec.policy.image!r}: the {backend} backend runs boxes on the "
            f"host's system only for now{cause}; images run on the bwrap backend (as root or "
            "as a user) and the oci backend with runc or crun (as root)"
        )


def sweep_boxes(backend: str, kill: Callable[[Path, dict[str, Any]], object]) -> list[str]:
    """Remove the state of ``backend``'s boxes whose owner died: ``kill(dir, owner)`` ends
    what the box still runs (from what its ``owner.json`` recorded), then the network's
    leftovers and the state directory go. Blocking: backends run it in a thread."""
    removed: list[str] = []
    for entry, owner in orphaned_boxes(backend):
        with contextlib.suppress(Exception):
            kill(entry, owner)
        sweep_network(entry / "net")  # pasta of a full-mode box, if any
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    tempws.sweep()  # the temporary workspaces of dead owners (any backend's)
    return removed


def kill_if_named(pid: int, comm_prefix: str) -> None:
    """SIGKILL ``pid`` if it still runs a program named ``comm_prefix...`` (a recorded pid
    may have been reused by an unrelated process since its owner died)."""
    if pid <= 0:
        return
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return
    if comm.startswith(comm_prefix):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


CHANNEL_BUFFER = 4 << 20
"""Send buffer of each end of a box's channel: a file read of many MiB then goes to the host
in few wakeups (the kernel caps it at ``net.core.wmem_max``)."""


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(host end, guest end) of a new box channel: a unix stream socketpair."""
    host_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (host_end, guest_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHANNEL_BUFFER)
    return host_end, guest_end


class BoxBase:
    """What every backend's box holds and does alike: its spec, the host end of the channel,
    its warnings, ``describe()`` and the ``close()`` sequence. A backend's box overrides
    :meth:`stats` (and the cheap counters), :meth:`stop`, :meth:`_teardown` and
    :meth:`_facts`."""

    backend: ClassVar[str] = ""
    """The backend's name, as ``describe()`` reports it."""

    heartbeat_timeout = 30.0
    """Seconds the agent may take to answer a heartbeat before the box is declared hung."""

    user_ids: tuple[int, int] = (COMMAND_HOST_ID, COMMAND_HOST_ID)
    """Host uid and gid of the box user (box uid 1000); a backend sets its box's own."""

    root_layer: RootLayer | None = None
    """The box's writable root on an image (None: none); a backend sets its box's own."""

    def __init__(
        self,
        spec: BoxSpec,
        channel: socket.socket,
        warnings: tuple[str, ...],
        limits: LimitPlan,
    ) -> None:
        self._spec = spec
        self._channel = channel
        self._warnings = warnings
        self._limits = limits
        self._closed = False

    @property
    def channel(self) -> socket.socket:
        return self._channel

    @property
    def warnings(self) -> tuple[str, ...]:
        """Limits the host could not enforce (for example a missing cgroup controller)."""
        return self._warnings

    def stats(self) -> BoxStats:
        return BoxStats()

    def oom_kills(self) -> int:
        return self.stats().oom_kills

    def pids_limit_hits(self) -> int:
        return self.stats().pids_limit_hits

    def observe_counters(self, counters: object) -> None:
        """Counters the agent reports with a command's exit: ignored where the host reads
        the box's cgroup itself."""

    def stop(self) -> None:
        """SIGKILL every process of the box now, without waiting (``close`` still cleans up)."""

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "sandbox_id": self._spec.sandbox_id,
            **self._facts(),
            **self._limits.describe(),  # the effective limits, as planned and applied
            "unenforced": list(self._warnings),
        }

    def _facts(self) -> dict[str, Any]:
        """Backend-specific facts for :meth:`describe` (runtime, accelerator, ...)."""
        return {}

    async def diagnose(self) -> str:
        return ""

    def check_layout(self) -> None:
        """Nothing to check where the backend checked its mounts while it started."""

    async def freeze(self, frozen: bool) -> None:
        """Stop (or restart) every process of the box; :class:`BackendUnavailable` where
        the backend cannot."""
        raise BackendUnavailable(
            f"pausing a box is not available on the {self._spec.policy.backend} backend "
            "(it needs the box's own cgroup with a freezer: bwrap, or oci with runc or crun, "
            "as root)"
        )

    async def close(self) -> None:
        """Close the channel, let the backend end the box (:meth:`_teardown`), then remove
        its state directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._channel.close()
        try:
            await self._teardown()
        finally:
            # In a thread: an OCI bundle's root is dozens of directories that were mount
            # points, and removing them took tens of ms.
            await blocking(shutil.rmtree, self._spec.state_dir, True)

    async def _teardown(self) -> None:
        """Kill everything in the box and release what the backend holds for it."""

    @staticmethod
    async def _release_host(
        cgroup: Cgroup | None,
        shared: Releasable | None = None,
        owner: Releasable | None = None,
        *,
        kill: bool = False,
    ) -> None:
        """The last step of every backend's :meth:`_teardown`, once the box's own process
        (bwrap, the OCI runtime's box, qemu) is gone: empty the cgroup (``kill``: SIGKILL
        what is left first) and remove it, unmount the shared paths (in a thread: an umount
        waits for an RCU grace period; before the state directory is deleted), and hand the
        namespace owner uid back for another box."""
        if cgroup is not None:
            if kill:
                with contextlib.suppress(Exception):
                    await cgroup.kill_all_async()
            with contextlib.suppress(Exception):
                await cgroup.remove_async()
        if shared is not None:
            await blocking(shared.release)
        if owner is not None:
            owner.release()  # the box's processes are gone: another box may own its uid


class ThawGuard:
    """A process outside the box that thaws its cgroup once this one is gone.

    A frozen process acts on no signal, SIGKILL included, until thawed: when the host
    process of a paused box died (``kill -9`` of ``corral serve``), the kills meant to end
    the box with it (bwrap's and its init's parent-death signals) stayed pending, and the
    box's processes lived on, frozen, until some later start swept them. The guard is a
    shell (~1 ms to start, no Python) reading a pipe only this process writes to: the read
    ends when this process closes its end or dies, and the guard then writes the thaw, the
    pending kills land, and it exits. In a session of its own, so a terminal's ^C to the
    host process's group does not take it along."""

    def __init__(self, child: HostChild, write_end: int) -> None:
        self._child = child
        self._write_end = write_end

    @classmethod
    async def start(cls, thaw: tuple[Path, str]) -> ThawGuard:
        read_end, write_end = os.pipe()
        try:
            child = await spawn(
                ["/bin/sh", "-c", 'read _; printf %s "$2" > "$1"', "corral-thaw", *map(str, thaw)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env={"PATH": SYSTEM_PATH},
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        child.reap_on_exit()
        return cls(child, write_end)

    async def release(self) -> None:
        """The box is thawed or gone: the guard writes once more (harmless) and exits."""
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._child.wait()
            self._child.close()


class CgroupBox(BoxBase):
    """A box with a cgroup of its own (bwrap, OCI): ``stats()``, ``oom_kills()`` and
    ``pids_limit_hits()`` read from it, and ``freeze()`` through its freezer."""

    _cgroup: Cgroup | None
    _thaw_guard: ThawGuard | None = None
    _own_pids: int = 0
    """The backend's own processes in the cgroup (bwrap's monitor and init): not counted in
    :attr:`BoxStats.pids`, which counts what ``limits.max_pids`` limits."""

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self._thaw_guard is not None:
                await self._thaw_guard.release()

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
            pids=None if s.pids_current is None else max(0, s.pids_current - self._own_pids),
            pids_limit_hits=s.pids_limit_hits,
            cpu_seconds=cpu,
        )

    async def freeze(self, frozen: bool) -> None:
        """The box's cgroup frozen or thawed (v1 freezer, v2 ``cgroup.freeze``)."""
        if self._cgroup is None:
            await super().freeze(frozen)  # BackendUnavailable: no cgroup of its own
            return
        thaw = self._cgroup.thaw_write()
        if frozen and self._thaw_guard is None and thaw is not None:
            self._thaw_guard = await ThawGuard.start(thaw)  # lives until the box is closed
        if not await self._cgroup.freeze_async(frozen, deadline=PAUSE_DEADLINE_S):
            if frozen:  # half-frozen is no state to leave a box in
                await self._cgroup.freeze_async(False)
            raise BackendError(
                f"the box's processes could not be {'frozen' if frozen else 'thawed'} (its "
                "cgroup has no freezer here, or a process did not stop within "
                f"{PAUSE_DEADLINE_S:.0f} s: one in uninterruptible I/O, for example); the box "
                "runs on as before"
            )


class Releasable(Protocol):
    """What a box holds on the host until it is gone: its shared paths' idmapped mounts
    (``host.idmap.SharedPaths``), its namespace owner uid (``host.ucounts.BoxOwner``)."""

    def release(self) -> None: ...


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

    @property
    def user_ids(self) -> tuple[int, int]:
        """Host uid and gid of the box user (box uid 1000): what the owner's files of an
        idmapped shared path appear as (the warm pool mounts a workspace so at a claim)."""
        ...

    @property
    def root_layer(self) -> RootLayer | None:
        """The upper layer of the box's writable root on an image, or None."""
        ...

    def stats(self) -> BoxStats: ...

    def oom_kills(self) -> int:
        """``stats().oom_kills`` alone, cheaply: read before and after every command."""
        ...

    def pids_limit_hits(self) -> int:
        """``stats().pids_limit_hits`` alone, cheaply: read before and after every command."""
        ...

    def observe_counters(self, counters: object) -> None:
        """The box's cgroup counters as the agent reported them with a command's exit (the
        ``box`` field): a box whose cgroup the host cannot read (a VM's) keeps them for
        :meth:`stats`; the others ignore them. Untrusted input: validate."""
        ...

    def stop(self) -> None:
        """SIGKILL every process of the box now, without waiting; once this returns no
        process of the box runs user code again (``close`` still cleans up). The warm pool
        uses it to hand a workspace back before the slower teardown."""
        ...

    def describe(self) -> dict[str, Any]:
        """Backend-specific facts for ``info()`` (backend name, isolation, limits)."""
        ...

    async def diagnose(self) -> str:
        """Why the box failed to start (the runtime's own error output), or ""."""
        ...

    def check_layout(self) -> None:
        """Called once the agent is ready, before any request: a PolicyError if a mount the
        backend made by path is not the object the host meant (a link swapped into a
        writable area while the box started). Cheap: nothing to do unless a mask or share
        lies inside a writable area."""
        ...

    async def freeze(self, frozen: bool) -> None:
        """Stop every process of the box, the guest agent included (``frozen``), or let them
        run again; BackendUnavailable where the backend cannot."""
        ...

    async def close(self) -> None:
        """Kill everything in the box and remove every trace of it. Idempotent."""
        ...


class Backend(Protocol):
    name: str

    @classmethod
    def for_policy(cls, policy: Policy) -> Backend:
        """A backend configured for ``policy`` (BackendUnavailable when it cannot run here).
        Cheap and without side effects: the orphan sweep and any build waits for
        :meth:`start`."""
        ...

    async def start(self, spec: BoxSpec) -> Box:
        """Start a box whose guest agent is connected to ``Box.channel``."""
        ...


SWEEP_EVERY = 60.0
"""Seconds between two full orphan sweeps of one backend in one process; in between, a
start sweeps again only when the owner of a box it saw before has died since."""

_sweep_lock = threading.Lock()
_last_sweep: dict[tuple[str, str], float] = {}
_owners: dict[Path, tuple[str, int]] = {}
"""State dirs seen by :func:`_dead_owner_seen` -> (backend, owner pid)."""


def _dead_owner_seen(backend: str) -> bool:
    """Whether a box of ``backend`` has an owner that died: a directory listing and one
    kill(pid, 0) per box, and one small read per box not seen before (cheap enough for the
    event loop, unlike the sweep itself)."""
    boxes = state_root() / "boxes"
    try:
        entries = list(os.scandir(boxes))
    except OSError:
        return False
    for entry in entries:
        path = Path(entry.path)
        known = _owners.get(path)
        if known is None:
            try:
                owner = json.loads((path / "owner.json").read_bytes())
                known = (str(owner.get("backend", "bwrap")), int(owner.get("host_pid", 0)))
            except (OSError, ValueError, TypeError, AttributeError):
                continue  # a box starting now, or one the full sweep judges by its age
            _owners[path] = known
        if known[0] == backend and not pid_alive(known[1]):
            return True
    if len(_owners) > 4 * len(entries) + 64:  # forget boxes that are gone
        for path in [p for p in _owners if not p.exists()]:
            del _owners[path]
    return False


class BackendBase:
    """What every backend does alike: sweep the boxes of dead owners before it starts a box,
    in a thread: at the first start of a process, then when a box's owner has died, and at
    least every :data:`SWEEP_EVERY` seconds."""

    name: str = ""
    owner_name: str = ""
    """The backend its boxes' ``owner.json`` names (the sweep's key), when not :attr:`name`."""

    def sweep_key(self) -> str:
        """What one sweep covers (a backend sweeping per runtime says which)."""
        return self.name

    def sweep_orphans(self) -> list[str]:
        """Remove what boxes of dead owners left behind. Blocking: see :meth:`prepare`."""
        return []

    async def prepare(self) -> None:
        """Run the orphan sweep if it is due, off the event loop. Every ``start`` awaits it
        first; concurrent first starts share one sweep."""
        key = (self.sweep_key(), str(state_root()))
        last = _last_sweep.get(key)
        if last is not None and time.monotonic() - last < SWEEP_EVERY:
            if not _dead_owner_seen(self.owner_name or self.name):
                return
            last = None  # due now: someone's box was orphaned since
        await blocking(self._sweep_if_due, key, last)

    def _sweep_if_due(self, key: tuple[str, str], seen: float | None) -> None:
        with _sweep_lock:
            if _last_sweep.get(key) != seen and seen is not None:
                return  # another start swept meanwhile
            self.sweep_orphans()
            _last_sweep[key] = time.monotonic()
