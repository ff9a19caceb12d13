"""``Sandbox``: one box, kept alive across commands, and everything you can do with it.

::

    async with corral.Sandbox(policy, workspace=path) as sb:
        r = await sb.run(["cargo", "check"], timeout=60)
        p = await sb.spawn("pytest -q")
        await p.wait(timeout=10)
        await sb.files.write("notes.txt", "hi")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import posixpath
import secrets
import shlex
import signal
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from corral import errors
from corral.agent import protocol
from corral.audit import AuditLog
from corral.backends import backend_for, backend_loaded
from corral.backends.base import Backend, Box, BoxSpec, BoxStats
from corral.backends.host import maskfollow, quota, tempws
from corral.backends.host.safepath import check_sources, refuse_inside, refuse_writable_policy
from corral.backends.host.state import BOX_PREFIX, state_root
from corral.backends.host.threads import blocking
from corral.backends.layout import box_env, shared_sources, writable_areas
from corral.backends.limits import agent_rlimits
from corral.channel import Channel
from corral.files import Files
from corral.models import CommandResult, NetworkRefusal, ProcessInfo, Snapshot, SnapshotProcesses
from corral.net import BoxNetwork
from corral.net.box import load_network, network_loaded
from corral.policy import DEFAULT_WORKDIR, Limits, Policy, PublishedPort, RlimitName
from corral.processes import (
    WRITE_CHUNK,
    Process,
    ProcessRegistry,
    checked_timeout,
    end_all,
    end_in_background,
)
from corral.sessions.pty import PtySession, SessionRegistry
from corral.sessions.terminal import (
    DEFAULT_DETACH_KEYS,
    AttachOutcome,
    attach_terminal,
    check_input,
    default_shell,
    parse_detach_keys,
    window_size,
)
from corral.streaming import ExecStream, PendingExecStream
from corral.workspaces import refuse_dangerous_workspace

if TYPE_CHECKING:
    from corral.images.resolve import BoxUser, ImageConfig
    from corral.net import Resolver

Command = str | Sequence[str]
StdinArg = bytes | str | Literal["pipe"] | None
READY_TIMEOUT = 15.0
"""Default seconds ``start`` waits for the guest agent's readiness (``ready_timeout``)."""
HEARTBEAT_EVERY = 5.0
"""Seconds between two heartbeats (a ``ping`` the agent answers from its loop)."""
ENDING_OPS = frozenset({"terminate", "signal"})
"""What closing a sandbox asks of processes still running (SIGTERM, SIGHUP, the grace)."""
PID_MAX = 1 << 22
"""Linux's PID_MAX_LIMIT: an agent reporting a larger pid is lying."""


def to_argv(cmd: Command) -> list[str]:
    """A string runs through ``/bin/sh -c``; a sequence is an argv."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise _invalid("empty command")
        return ["/bin/sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv or not argv[0]:
        raise _invalid("empty command: give a program and its arguments")
    if any("\0" in a for a in argv):
        raise _invalid(f"a NUL byte in the command {argv!r}: no program can take one")
    return argv


def _checked_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` as the kernel takes it: names without ``=`` or NUL, values without NUL (the
    agent's exec would fail on the host's behalf, as a ``backend_failed``)."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in str(value):
            raise _invalid(
                f"environment variable {name!r}: a name is non-empty, without '=' or NUL, "
                "and a value without NUL"
            )
    return env


def _resolve_image(policy: Policy) -> tuple[ImageConfig, BoxUser]:
    """The config of ``policy.image`` and who its commands run as (blocking: a registry
    ref may be pulled; an image ``User`` that is none of the box users is a PolicyError)."""
    from corral.images.resolve import box_user, resolve_image

    image = resolve_image(policy.image, cow=True)  # the config: no snapshot made plain
    return image.config, box_user(image, policy.user)


def _invalid(message: str) -> errors.SandboxError:
    return errors.SandboxError(message, code=errors.ErrorCode.INVALID_INPUT)


def _forget_with_the_last(ref: str, n: int) -> Callable[[], None]:
    """A close hook for ``n`` forks: the last one closed removes their snapshot ``ref`` from
    the image store (its subvolume and workspace copy with it). Blocking."""
    left, lock = [n], threading.Lock()

    def hook() -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        from corral.images.store import ImageStore

        with contextlib.suppress(errors.SandboxError, OSError):
            ImageStore().forget(ref)

    return hook


def _seed_workspace(image: str, workspace: Path) -> None:
    """Fill a new box's own (empty) workspace with the copy of its box's workspace that the
    snapshot ``image`` kept, if it kept one. Unpacked as any layer (no entry leaves the
    workspace, no link is followed, no device node is made). Blocking."""
    from corral.images.store import ImageStore, is_path

    if is_path(image):
        return  # a layout, an archive or a plain root: never a snapshot
    from corral.images.registry import parse_ref
    from corral.images.unpack import unpack_layer

    try:
        ref = str(parse_ref(image))
    except errors.SandboxError:
        return  # the image's own resolution says what is wrong with it
    store = ImageStore()
    record = store.get(ref)
    tar = store.workspace_of(record) if record is not None else None
    if tar is None:
        return
    try:
        with open(tar, "rb") as blob:
            unpack_layer(blob, workspace, store.limits)
    except OSError as exc:
        raise errors.SandboxError(
            f"cannot copy snapshot {ref}'s workspace into the box's ({exc.strerror or exc}); "
            "a capped workspace (filesystem.workspace_size) may be too small for it",
            code=errors.ErrorCode.FILE_ERROR,
        ) from None


_RLIMIT_NAMES: tuple[str, ...] = typing.get_args(RlimitName)


def _checked_rlimits(
    rlimits: Mapping[RlimitName, int] | Mapping[str, int] | None, limits: Limits
) -> dict[str, int]:
    """A call's rlimits, refused as a PolicyError naming the entry when the agent could not
    set it (an unknown name, a value that is not a count, more open files than the box's
    cap: commands inherit it as their hard limit and hold no capability to raise it)."""
    cap = agent_rlimits(limits)["nofile"]
    wanted = (rlimits or {}).get("nofile")
    if isinstance(wanted, int) and wanted > cap:
        raise errors.PolicyError(
            f"rlimits.nofile: {wanted} is above this box's open-file cap ({cap}); a call may "
            "only lower it: raise limits.rlimits.nofile in the policy"
        )
    out: dict[str, int] = {}
    for name, value in (rlimits or {}).items():
        if name not in _RLIMIT_NAMES:
            raise errors.PolicyError(
                f"rlimits.{name}: unknown rlimit; use one of {', '.join(_RLIMIT_NAMES)}"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise errors.PolicyError(f"rlimits.{name}: {value!r} is not a count >= 0")
        out[name] = value
    return out


def as_policy(
    policy: Policy | str | os.PathLike[str] | None, workspace: Path | None = None
) -> Policy:
    """A :class:`Policy` from a policy, a policy file's path, or None (the default policy),
    with relative host paths resolved against ``workspace`` when it is known."""
    if policy is None:
        policy = Policy()
    elif isinstance(policy, (str, os.PathLike)):
        policy = Policy.load(policy)
    elif not isinstance(policy, Policy):
        raise errors.PolicyError(
            f"policy must be a corral.Policy or the path of a policy file, "
            f"not {type(policy).__name__}"
        )
    return policy.for_workspace(workspace) if workspace is not None else policy


def _check_host_paths(policy: Policy, workspace: Path, given: bool = False) -> None:
    """Host files corral uses itself (the audit log root appends to, the secrets file) never
    lie in an area a box can write, and no shared source there is a link (blocking).
    ``given``: the caller's workspace, refused if it is /, a system or a home directory."""
    if given:
        refuse_dangerous_workspace(workspace)
    areas = writable_areas(policy, workspace)
    refuse_writable_policy(policy.loaded_from, areas)
    refuse_inside("audit_log", policy.audit_log, areas)
    refuse_inside("secrets_file", policy.secrets_file, areas)
    sources = shared_sources(policy)
    for field, path in sources:
        # Named here, once: each backend would fail at start in its own words.
        if not os.path.exists(path):
            raise errors.PolicyError(
                f"{field} {path} does not exist on the host: create it, or take it out of "
                "the policy"
            )
    check_sources(sources, areas)


STDIN_CHUNK = WRITE_CHUNK
"""``stdin=`` data beyond this goes to the box in ``Process.write`` chunks of this size (a
message carries at most 16 MiB); the guest agent feeds them to the command as it reads."""


class Sandbox:
    """A Linux sandbox running the guest agent. Use as ``async with Sandbox(...) as sb``."""

    def __init__(
        self,
        policy: Policy | str | os.PathLike[str] | None = None,
        *,
        workspace: str | os.PathLike[str] | None = None,
        backend: Backend | None = None,
        resolver: Resolver | None = None,
        allow_dangerous_workspace: bool = False,
        ready_timeout: float | None = None,
        exposable: bool = False,
    ) -> None:
        """``policy``: a :class:`Policy`, or the path of a policy file (TOML or JSON, see
        :meth:`Policy.load`). ``resolver``: how the egress proxy (network mode ``allowlist``)
        resolves names; default the host's resolver. A :class:`corral.net.StaticResolver`
        pins names.

        ``workspace``: a host directory the box gets read-write (default: a fresh temporary
        one). ``start`` refuses ``/``, a system directory and a home directory (or one holding
        a home) with :class:`~corral.errors.DangerousWorkspace`, since the box may change
        anything there; ``allow_dangerous_workspace=True`` shares it anyway.

        ``ready_timeout``: seconds ``start`` gives the box, from the backend's start to its
        guest agent's readiness, before it fails with ``BackendError`` (default: the
        backend's own waits, :data:`READY_TIMEOUT` for the agent; a microVM booting without
        KVM may take a minute and more).

        ``exposable``: :meth:`expose` may publish box ports after the start even in network
        mode ``none`` (the box gets an empty network directory bound; every other mode, or
        a policy that publishes ports, has one anyway)."""
        self._allow_dangerous_workspace = allow_dangerous_workspace
        self._exposable = exposable
        if ready_timeout is not None and (
            isinstance(ready_timeout, bool)
            or not (isinstance(ready_timeout, int | float) and 0 < ready_timeout < float("inf"))
        ):
            raise errors.SandboxError(
                f"ready_timeout must be a number of seconds > 0, got {ready_timeout!r}",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        self._ready_timeout = None if ready_timeout is None else float(ready_timeout)
        self._workspace_arg = Path(workspace).resolve() if workspace is not None else None
        self.policy = as_policy(policy, self._workspace_arg)
        self._resolver = resolver
        self._network: BoxNetwork | None = None
        self.image_config: ImageConfig | None = None
        """The config of ``policy.image`` once started (None for ``host``): its ``Env`` goes
        under the policy's ``env``, its ``WorkingDir`` is the default cwd unless the policy
        moves ``workdir``, its ``cmd`` is what ``corral run --image REF`` runs by default."""
        self.user: BoxUser = self.policy.user or "user"
        """Who commands run as (``policy.user``, else the image's ``User``, else ``user``)."""
        self._backend = backend
        self._box: Box | None = None
        self._channel: Channel | None = None
        self._owned_workspace: Path | None = None
        self._quota_workspace: Path | None = None
        """A temporary workspace with a size/inode cap (a tmpfs), removed at close."""
        self.workspace: Path | None = self._workspace_arg
        self.sandbox_id = BOX_PREFIX + secrets.token_hex(6)
        tracking = self.policy.process_tracking
        self._registry = ProcessRegistry(tracking.max_tracked if tracking.enabled else 0)
        self._sessions = SessionRegistry()
        self.files = Files(self.policy, self._request, self._host_files_area)
        self._closed = False
        self._closing_ops: frozenset[str] = frozenset()
        """Requests ``aclose`` still makes once the sandbox is closed to its callers."""
        self._broken: str | None = None
        self._after_close: list[Callable[[], object]] = []
        self._heartbeat: asyncio.Task[None] | None = None
        self._workspace_prepared = False  # set by SandboxPool for its staging directories
        self._paused = False
        self.audit = AuditLog.for_policy(self.policy, self.sandbox_id)
        """The sandbox's audit log (records nothing unless ``policy.audit_log`` is set)."""
        self.files.on_denied = self._audit_file_denied
        # Box counters (OOM kills, pids-limit hits) already reported as violations.
        self._seen_violations = (0, 0)
        self._hints: tuple[str, ...] | None = None  # what in the workspace won't run here
        self._notes: tuple[str, ...] = ()  # a fork's: what its snapshot could not keep
        self._spawn_marks: dict[int, int] = {}

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._box else "not started")
        return f"<Sandbox {self.sandbox_id} {state} workspace={self.workspace}>"

    async def __aenter__(self) -> Sandbox:
        if self._box is None or self._closed:  # a pool hands out started sandboxes
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _host_files_area(self) -> str | None:
        """The workspace's host directory, through which the files API moves a large file's
        bytes (:mod:`corral.files`); None keeps them on the agent's channel: a capped
        workspace charges its pages to the box's memory as the box writes them."""
        if self._box is None or self._quota_workspace is not None or self.workspace is None:
            return None
        return os.fspath(self.workspace)

    async def _box_network(self, state_dir: Path) -> BoxNetwork | None:
        if self.policy.network.mode != "none" and not network_loaded():
            # The first networked box of a process imports the proxy, NAT, relays and rules
            # (tens of ms): in a thread, as the backend's first import is.
            await blocking(load_network)
        return BoxNetwork.for_policy(
            self.policy.network,
            state_dir / "net",
            audit=self.audit,
            resolver=self._resolver,
            exposable=self._exposable,
        )

    async def _own_workspace(self) -> None:
        """A temporary workspace of the box's own (a capped tmpfs when the policy asks),
        filled from the snapshot it starts on when that kept one."""
        if quota.asked(self.policy):  # a tmpfs of that size (a host dir can't be capped)
            self._quota_workspace = await blocking(
                quota.make_workspace, self.policy, self.sandbox_id
            )
            self._owned_workspace = self._quota_workspace
        else:
            self._owned_workspace = await blocking(tempws.make, self.sandbox_id)
        self.workspace = self._owned_workspace
        if self.policy.image != "host":  # a snapshot's copy of its box's workspace
            try:
                await blocking(_seed_workspace, self.policy.image, self._owned_workspace)
            except BaseException:
                await self.aclose()
                raise
        resolved = self.policy.for_workspace(self._owned_workspace)
        if resolved is not self.policy:
            self.policy = resolved
            self.files.use_policy(resolved)

    async def start(self) -> None:
        if self._box is not None or self._closed:
            raise errors.SandboxClosed("a Sandbox can be started once; create a new one")
        if self._workspace_arg is None:
            await self._own_workspace()
        elif not self._workspace_arg.is_dir():
            raise errors.SandboxError(
                f"workspace {self._workspace_arg} is not a directory; create it or pick another",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        else:
            quota.refuse_for_host_dir(self.policy, self._workspace_arg)
        assert self.workspace is not None
        given = self._workspace_arg is not None and not self._workspace_prepared
        await blocking(
            _check_host_paths,
            self.policy,
            self.workspace,
            given and not self._allow_dangerous_workspace,
        )
        backend = self._backend
        if backend is None:
            # The first use imports the backend and probes the host: in a thread.
            if backend_loaded(self.policy):
                backend = backend_for(self.policy)
            else:
                backend = await blocking(backend_for, self.policy)
        if self.policy.image != "host":
            # A registry ref is pulled here (then the backend finds it stored).
            self.image_config, self.user = await blocking(_resolve_image, self.policy)
        state_dir = state_root() / "boxes" / self.sandbox_id
        self._network = await self._box_network(state_dir)
        spec = BoxSpec(
            policy=self.policy,
            workspace=self.workspace,
            sandbox_id=self.sandbox_id,
            state_dir=state_dir,
            network=self._network,
            workspace_prepared=self._workspace_prepared,
            ready_timeout=self._ready_timeout,
            user=self.user,
        )
        try:
            if self._network is not None:
                await self._network.start()
            box, left = await self._start_box(backend, spec)
            self._box = box
            self._channel = Channel(box.channel, self._on_event)
            self._channel.on_lost = self._on_lost
            await self._channel.start()
            try:
                await self._channel.wait_ready(left())
            except errors.BackendError as exc:
                raise errors.BackendError(await self._not_ready(exc, box)) from None
            box.check_layout()  # mounts made by path are what the host meant
            if not self._workspace_prepared:  # masked objects still where they were masked
                await blocking(maskfollow.recheck, self.policy, self.workspace)
            if self._network is not None:
                await self._network.ready()
            if self._workspace_prepared:
                # A pooled box waits to be claimed: let its agent finish what it loads after
                # "ready" (os, its command and file modules: ~9 M instructions) now, or the
                # first claim waits for it. The agent answers this ping only once that is done.
                await self._channel.request("ping")
        except BaseException:
            await self.aclose()
            raise
        self._heartbeat = asyncio.create_task(self._beat(), name="corral-heartbeat")
        self.audit.record(
            "sandbox", event="start", backend=self.policy.backend, workspace=str(self.workspace)
        )

    async def _not_ready(self, exc: errors.BackendError, box: Box) -> str:
        """Why the agent did not become ready: the wait, the backend's own words, the fix."""
        message = exc.message
        if self._ready_timeout is not None:
            message = f"the box was not ready within {self._ready_timeout:g} s (ready_timeout)"
        detail = await box.diagnose()
        message = f"{message}: {detail}" if detail else message
        if self._channel is not None and not self._channel.lost.is_set():  # still starting
            message += "; a slow host may need Sandbox(..., ready_timeout=SECONDS)"
        return message

    async def _start_box(self, backend: Backend, spec: BoxSpec) -> tuple[Box, Callable[[], float]]:
        """``backend.start`` (a backend with a boot wait of its own, the microVM's, takes the
        caller's ``ready_timeout`` from ``spec``), and what is left of ``ready_timeout`` for
        the agent's readiness (a function: asked when that wait starts)."""
        loop = asyncio.get_running_loop()
        given = self._ready_timeout
        started = loop.time()
        box = await backend.start(spec)
        if given is None:
            return box, lambda: READY_TIMEOUT
        return box, lambda: max(0.0, started + given - loop.time())

    async def aclose(self) -> None:
        """End everything in the box and remove every trace of it. Idempotent.

        Processes still running get what a timeout gives them: SIGTERM to their groups (and
        SIGHUP to open shells), ``limits.kill_grace_secs`` for all of them together, then
        SIGKILL; anything else left in the box is killed with it."""
        if self._closed:
            return
        if self._paused and self._box is not None:  # thawed, so it can end as any box does
            with contextlib.suppress(errors.SandboxError):
                await self._box.freeze(False)
            self._paused = False
        self._closed = True
        interrupted = False
        try:
            if self._heartbeat is not None:
                self._heartbeat.cancel()
                await asyncio.wait([self._heartbeat])  # a cancel of this close goes through
            if self._channel is not None and not self._channel.lost.is_set():
                # What still runs ends as a timeout ends it: SIGTERM to every group at once
                # (and a SIGHUP to each shell on a terminal), one grace for all, SIGKILL to
                # what is left.
                shells = [session.process for session in self._sessions.list()]
                self._closing_ops = ENDING_OPS  # closed to callers, open to the ending
                try:
                    await end_all(self._registry.running(), hang_up=shells)
                finally:
                    self._closing_ops = frozenset()
                with contextlib.suppress(errors.SandboxError, TimeoutError):
                    async with asyncio.timeout(2):
                        await self._channel.request("shutdown")
        except asyncio.CancelledError:
            # Cancelled in the grace or the shutdown: cut them short (the teardown kills
            # everything), but tear the box down before the cancellation goes through.
            interrupted = True
        # The teardown runs to its end whatever is cancelled meanwhile: cut half way, it left
        # the workspace's mount, cgroups and state behind, and this close cannot run again.
        teardown = asyncio.ensure_future(self._teardown())
        while not teardown.done():
            try:
                await asyncio.shield(teardown)
            except asyncio.CancelledError:
                interrupted = True
        teardown.result()
        if interrupted:
            raise asyncio.CancelledError

    async def _teardown(self) -> None:
        """What :meth:`aclose` does once the box's processes have ended: the box, its
        network, its state, sessions and workspace, and the audit's last record."""
        if self._channel is not None:
            await self._channel.close()
        if self._box is not None:
            await self._box.close()
        if self._network is not None:
            await self._network.close()
        # A start that failed (after the network's directory was made, or in a backend that
        # cleared its attempt) leaves the box's state directory empty: remove it (if empty).
        with contextlib.suppress(OSError):
            (state_root() / "boxes" / self.sandbox_id).rmdir()
        for proc in self._registry.running():
            proc._lost()
        await self._sessions.aclose()  # after the processes: their shells are gone by now
        for hook in self._after_close:
            await blocking(hook)
        if self._quota_workspace is not None:
            await blocking(quota.release_workspace, self._quota_workspace)
            self._quota_workspace = self._owned_workspace = None
        if self._owned_workspace is not None:
            await blocking(tempws.remove, self.sandbox_id, self._owned_workspace)
        self.audit.record("sandbox", event="close", broken=self._broken)
        self.audit.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> str | None:
        """Why the box died under its sandbox (its agent exited, the channel broke), or None
        while it is sound: every request then raises :class:`SandboxBroken` with this."""
        return self._broken

    # ---- the warm pool's hooks (corral.pool) ---------------------------------------------
    @classmethod
    def on_staging(
        cls,
        policy: Policy,
        staging: Path,
        *,
        backend: Backend | None = None,
        release: Callable[[], object] | None = None,
    ) -> Sandbox:
        """A sandbox whose box binds ``staging`` (an empty directory the warm pool mounts a
        workspace on later) as it is, instead of a workspace. ``release`` runs in a thread
        once the box is gone (the pool unmounts and removes the staging directory)."""
        sb = cls(policy, workspace=staging, backend=backend)
        sb._workspace_prepared = True
        if release is not None:
            sb._after_close.append(release)
        return sb

    @property
    def user_host_ids(self) -> tuple[int, int]:
        """Host uid and gid of the started box's user (box uid 1000): each box has its own
        where its backend gives it one. The warm pool mounts a workspace idmapped to them."""
        if self._box is None:
            raise errors.SandboxClosed("the sandbox is not started")
        return self._box.user_ids

    def lend_workspace(self, workspace: Path, *, owned: bool = False) -> None:
        """Record that ``workspace`` is now mounted on this box's staging directory (the
        pool's claim); ``owned``: a temporary directory removed when the sandbox closes."""
        self.workspace = workspace
        self._owned_workspace = workspace if owned else None

    def stop(self) -> None:
        """Kill every process of the box now, without waiting for the teardown: once this
        returns nothing in the box runs again. ``aclose()`` is still needed."""
        if self._box is not None:
            self._box.stop()

    @property
    def published(self) -> tuple[PublishedPort, ...]:
        """The box ports published on the host (``policy.network.publish``), each with the
        host port it got (the one picked for ``host_port=0``)."""
        return self._network.published if self._network is not None else ()

    async def expose(
        self, port: int, *, host_port: int = 0, host_ip: str = "127.0.0.1"
    ) -> PublishedPort:
        """Publish box ``port`` on the host after the start (``publish`` in the policy does
        it at the start): connections to ``host_ip:host_port`` (0: any free port, the one
        returned) reach ``127.0.0.1:port`` in the box, as :attr:`published` lists.

        Needs a box whose network directory is bound (network mode ``allowlist``,
        ``ports`` or ``full``, or any ``publish`` in the policy) on the bwrap or oci
        backends; elsewhere a :class:`~corral.errors.BackendUnavailable` that says how."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise errors.PolicyError(f"not a TCP port to expose: {port!r} (1-65535)")
        spec = PublishedPort.parse(f"[{host_ip}]:{host_port}:{port}")
        await self._request("ping")  # closed or broken: say so first
        network, backend = self._network, self.policy.backend
        if network is None:
            raise errors.BackendUnavailable(
                f"cannot expose port {port}: a box with network mode 'none' and nothing in "
                "network.publish has no way in from the host; start it with "
                "Sandbox(exposable=True), or publish the port at the start (corral run -p)"
            )
        if backend not in ("bwrap", "bwrap-rootless", "oci"):
            raise errors.BackendUnavailable(
                f"cannot expose port {port} after the start on the {backend} backend; "
                "publish it at the start (network.publish, corral run -p)"
            )
        for published in network.published:
            if published.box_port == port:  # exposed already: the same answer again
                return published
        config = await network.publish(spec)
        try:
            await self._request("publish", **config)
        except BaseException:
            await network.unpublish(port)
            raise
        published = next(p for p in network.published if p.box_port == port)
        self.audit.record("network", event="expose", box_port=port, host_port=published.host_port)
        return published

    async def unexpose(self, port: int) -> bool:
        """Stop publishing box ``port`` (from :meth:`expose` or the policy): its host port
        refuses connections from now on. False when it was not published."""
        if self._network is None:
            return False
        closed = await self._network.unpublish(port)
        if closed:
            self.audit.record("network", event="unexpose", box_port=port)
        return bool(closed)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Limits of the policy the host could not enforce, and what in the workspace will
        not run in the box (a venv whose interpreter it does not see); empty when all hold."""
        if self._box is None:
            return ()
        if self._hints is None:
            from corral.tools.presets import venv_hints

            ws = self.workspace
            self._hints = tuple(venv_hints(ws, self.policy)) if ws is not None else ()
        return (*self._box.warnings, *self._hints, *self._notes)

    async def _request(
        self, op: str, payload: bytes | memoryview = b"", *, pieces: bool = False, **fields: Any
    ) -> Any:
        """One agent call; ``pieces``: a large reply payload as the pieces it came in."""
        if self._closed and op not in self._closing_ops:
            raise errors.SandboxClosed("the sandbox is closed")
        if self._broken is not None:
            raise errors.SandboxBroken(f"the sandbox is gone: {self._broken}")
        if self._channel is None:
            raise errors.SandboxClosed("the sandbox is not started; use `async with Sandbox()`")
        if self._paused and op not in self._closing_ops:
            raise errors.SandboxPaused(
                f"the sandbox is paused, so it cannot {op}: `await sandbox.resume()` first"
            )
        if pieces:
            return await self._channel.request_pieces(op, payload, **fields)
        return await self._channel.request(op, payload, **fields)

    async def _beat(self) -> None:
        """Ping the agent every :data:`HEARTBEAT_EVERY` seconds; one that does not answer
        within the box's ``heartbeat_timeout`` (a hung VM, a stopped agent) gets its box
        killed, and every pending and later call fails saying so."""
        channel, box = self._channel, self._box
        assert channel is not None and box is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEARTBEAT_EVERY):
                    await channel.lost.wait()
            if channel.lost.is_set():
                return
            if self._paused:
                continue  # a frozen agent cannot answer; it is not hung
            deadline = box.heartbeat_timeout
            try:
                async with asyncio.timeout(deadline):
                    await channel.request("ping")
            except TimeoutError:
                break
            except errors.SandboxError:
                return  # lost meanwhile: the channel reported why
        reason = (
            f"the sandbox stopped answering (no reply to a heartbeat within {deadline:g} s) "
            "and was killed; start a new one"
        )
        self.audit.record("sandbox", event="unresponsive", timeout=deadline)
        channel.abandon(reason)
        await box.close()

    def _on_event(self, header: dict[str, Any], payload: bytes) -> None:
        proc = self._registry.find(header["pid"])
        if proc is None:
            return  # a process we forgot (tracking cap) or never started: nothing to feed
        if header["ev"] == "out":
            proc._on_output(header["stream"], payload)
        elif header["ev"] == "exit":
            if self._box is not None and "box" in header:  # a microVM's guest cgroup
                self._box.observe_counters(header["box"])
            duration = header.get("duration")
            proc._on_exit(header["exit_code"], duration if isinstance(duration, float) else None)
            cpu, rss = header.get("cpu_seconds"), header.get("max_rss_bytes")
            if isinstance(cpu, (int, float)) and isinstance(rss, int):
                proc.final_usage = (float(cpu), rss)
            self._registry.on_exit()
            if self.audit.enabled:
                self._audit_exit(proc)

    def _audit_exit(self, proc: Process) -> None:
        oom_at_spawn = self._spawn_marks.pop(proc.pid, None)
        stats = self._box.stats() if self._box is not None else BoxStats()
        self.audit.record(
            "command",
            event="exit",
            pid=proc.pid,
            exit_code=proc.exit_code,
            duration=proc.duration,
            timed_out=proc.timed_out,
            oom_killed=oom_at_spawn is not None and stats.oom_kills > oom_at_spawn,
        )
        if proc.exit_code == -signal.SIGSYS:
            self.audit.record(
                "violation", type="seccomp", pid=proc.pid, argv=proc.argv, signal="SIGSYS"
            )
        self._audit_limits(stats)

    def _audit_limits(self, stats: BoxStats) -> None:
        """Report OOM kills and refused forks the box's cgroup counted since last time."""
        oom_seen, pids_seen = self._seen_violations
        if stats.oom_kills > oom_seen:
            self.audit.record("violation", type="oom", count=stats.oom_kills - oom_seen)
        if stats.pids_limit_hits > pids_seen:
            hits = stats.pids_limit_hits - pids_seen
            self.audit.record("violation", type="pids_limit", count=hits)
        self._seen_violations = (
            max(oom_seen, stats.oom_kills),
            max(pids_seen, stats.pids_limit_hits),
        )

    def _audit_file_denied(self, op: str, path: str, reason: str) -> None:
        self.audit.record("file_denied", op=op, path=path, reason=reason)

    def _on_lost(self, reason: str) -> None:
        if not self._closed:
            self._broken = reason
        # Also while closing: a close waiting out the grace stops waiting for a dead box.
        for proc in self._registry.running():
            proc._lost()

    async def spawn(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: StdinArg = None,
        rlimits: dict[RlimitName, int] | None = None,
        pty: bool = False,
        cols: int = 80,
        rows: int = 24,
    ) -> Process:
        """Start a command in the background and return its handle at once."""
        argv = to_argv(cmd)
        fields: dict[str, Any] = {
            "argv": argv,
            "cwd": self._cwd(cwd),
            "env": {**self._env(), **_checked_env(env or {})},
            "rlimits": {
                **self.policy.limits.rlimits,
                **_checked_rlimits(rlimits, self.policy.limits),
            },
            "pty": pty,
            "cols": cols,
            "rows": rows,
        }
        payload = b""
        rest = b""
        if stdin == "pipe" or pty:
            fields["stdin"] = "pipe"
        elif stdin is None:
            fields["stdin"] = "null"
        else:
            fields["stdin"] = "data"
            payload = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
            if len(payload) > STDIN_CHUNK:  # the rest follows in ``write`` chunks
                fields["stdin"] = "pipe"
                payload, rest = payload[:STDIN_CHUNK], payload[STDIN_CHUNK:]
        holder: list[Process] = []

        def register(reply: dict[str, Any]) -> None:
            pid = reply.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= PID_MAX:
                raise protocol.FrameError(f"spawn reply with a bad pid {pid!r}")
            limits = self.policy.limits
            proc = Process(
                pid, argv, limits.output_bytes, self._request, kill_grace=limits.kill_grace_secs
            )
            self._registry.add(proc)
            holder.append(proc)
            # Here, as the reply arrives, not once the caller resumes: a quick command's exit
            # may be read before then, and its spawn record must come first.
            if self.audit.enabled:
                self._spawn_marks[pid] = self.oom_kills()
                self.audit.record(
                    "command", event="spawn", argv=argv, cwd=fields["cwd"], pid=pid, pty=pty
                )

        # Shielded: a caller cancelled while the agent starts the command gets no handle, so
        # the command it started anyway is ended here (``_end_orphan``), not left running.
        started = asyncio.ensure_future(
            self._request("spawn", payload, on_reply=register, **fields)
        )
        try:
            await asyncio.shield(started)
        except asyncio.CancelledError:
            started.add_done_callback(lambda _: _end_orphan(started, holder))
            raise
        proc = holder[0]
        if rest:
            await self._stream_stdin(proc, rest)
        return proc

    async def _stream_stdin(self, proc: Process, data: bytes) -> None:
        """The rest of a large ``stdin=`` in chunks, then end of input. A command that stops
        reading (exits, closes its stdin) ends the upload, as a broken pipe would."""
        try:  # in ``Process.write``'s pieces (a view of ``data``: no copy on the host)
            await proc.write(data, eof=True)
        except (errors.ProcessNotFound, errors.SpawnFailed):
            return
        except errors.SandboxError as exc:
            if exc.code is errors.ErrorCode.INVALID_INPUT:  # its stdin is closed
                return
            raise

    async def snapshot(
        self,
        name: str,
        *,
        processes: SnapshotProcesses = "warn",
        workspace: bool = False,
    ) -> Snapshot:
        """The box's filesystem state as an image named ``name`` in the image store: its
        image with what the box changed in its writable root (the overlay's upper) on top,
        and with ``workspace=True`` a copy of its workspace, which boxes restored from it
        without a workspace of their own (forks, :meth:`restore`) start with. The box is
        paused while it is read, so the snapshot is consistent, then goes on.
        ``Sandbox(Policy(image=ref))``, :meth:`restore` and ``corral run --image`` take the
        returned ref (a :class:`Snapshot`, a ``str``).

        Processes and memory are not kept (corral cannot checkpoint them here: CRIU, see
        ``docs/images.md``). When processes besides the guest agent run in the box,
        ``processes="warn"`` (the default) makes a filesystem-only snapshot and says so in
        :attr:`Snapshot.warnings`; ``processes="error"`` refuses with
        :class:`ProcessStateUnavailable`, naming why their state cannot be saved."""
        from corral.images.registry import parse_ref
        from corral.images.store import ImageStore

        if processes not in ("warn", "error"):
            raise _invalid(f"snapshot(processes=...) is 'warn' or 'error', not {processes!r}")
        if self._box is None or self._closed:
            raise errors.SandboxClosed("the sandbox is not running")
        store = ImageStore()
        base = await blocking(lambda: store.resolve(self.policy.image, pull=False))
        if base is None:
            raise _invalid(
                "a snapshot builds on an image of the store (a registry ref, an OCI layout or "
                f"an archive), and {self.policy.image!r} is a plain root directory"
            )
        ref = str(parse_ref(name))
        paused_here = not self._paused
        if paused_here:
            await self.pause()
        try:
            running, warnings = await self._unkept_processes(processes)
            root = self._box.root_layer
            with store.scratch() as tmp:
                kept = None
                if workspace:
                    kept = tmp / "workspace.tar"
                    await blocking(self._export_workspace, kept)
                if root is not None and root.subvolume is not None:  # O(1): copy on write
                    subvolume, skip = root.subvolume, root.mount_points
                    await blocking(
                        lambda: store.commit_cow(
                            ref,
                            base,
                            subvolume,
                            mount_points=skip,
                            workspace=kept,
                        )
                    )
                else:  # a tmpfs upper: copied out as a layer
                    layer = tmp / "layer.tar"
                    await self.export_root(layer)
                    config = dict(base.config)
                    await blocking(
                        lambda: store.commit(
                            ref, base, [layer], config, source="snapshot", workspace=kept
                        )
                    )
        finally:
            if paused_here:
                await self.resume()
        self.audit.record(
            "sandbox", event="snapshot", ref=ref, workspace=workspace, processes=running
        )
        return Snapshot(ref, warnings=warnings, workspace=workspace, processes=running)

    async def _unkept_processes(self, choice: SnapshotProcesses) -> tuple[int, tuple[str, ...]]:
        """The processes besides the guest agent in the (paused) box, and the warning a
        snapshot gives for them; :class:`ProcessStateUnavailable` when the caller chose
        ``error``. -1: the box's processes cannot be counted (no cgroup of its own)."""
        assert self._box is not None
        pids = self._box.stats().pids
        running = -1 if pids is None else max(0, pids - 1)  # the agent is one of them
        if running == 0:
            return 0, ()
        from corral.backends.host.criu import process_state_unavailable

        why = await blocking(process_state_unavailable, self._box.describe()["backend"])
        what = (
            "the box's processes cannot be counted here"
            if running < 0
            else f"{running} process{'es' if running > 1 else ''} besides the guest agent "
            f"{'were' if running > 1 else 'was'} running"
        )
        if choice == "error":
            raise errors.ProcessStateUnavailable(
                f"cannot keep the box's processes in a snapshot: {what}, and {why} "
                "(snapshot(processes='warn') keeps the filesystem alone)"
            )
        return running, (f"filesystem-only snapshot: {what}, not kept ({why})",)

    def _export_workspace(self, dest: Path) -> int:
        """The workspace as a layer tar at ``dest`` (the store's scratch: no box writes
        there), without what the box's ``deny_read`` masks hide. The box wrote it: read as
        hostile (:func:`write_layer`: no link followed, device nodes and sockets left out,
        setuid bits dropped, hard links kept within). Its files are recorded as uid/gid 0:
        whoever owns the workspace they are restored to. Blocking."""
        from corral.backends.host.safepath import open_regular
        from corral.images.export import write_layer

        assert self.workspace is not None
        # What the box's masks hide is not the snapshot's to keep: a box restored from it
        # (any policy) would read it.
        hidden = maskfollow.masked_objects(self.policy, self.workspace)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with open(open_regular(dest, flags, 0o600), "wb") as out:
            return write_layer(self.workspace, out, lambda _: 0, skip_ids=hidden)

    async def fork(
        self,
        n: int,
        *,
        name: str | None = None,
        processes: SnapshotProcesses = "warn",
        workspace: bool = False,
    ) -> list[Sandbox]:
        """``n`` new started sandboxes from this box's filesystem state (a :meth:`snapshot`,
        kept as ``name`` or a generated ref), each with its own writable root and a fresh
        workspace of its own (a copy of this box's with ``workspace=True``, else empty):
        they diverge independently. ``processes``: as for :meth:`snapshot` (its warning is
        in each fork's :attr:`warnings`). Closing them is the caller's; a generated
        snapshot is removed from the store with the last of them."""
        if n < 1:
            raise _invalid(f"fork(n) needs n >= 1, not {n}")
        snap = await self.snapshot(
            name or f"corral-fork.invalid/{self.sandbox_id}:{n}",
            processes=processes,
            workspace=workspace,
        )
        boxes = [Sandbox.restore(snap, self.policy) for _ in range(n)]
        forget = _forget_with_the_last(str(snap), n) if name is None else None
        for fork in boxes:  # Sandboxes, not Boxes (test_backend_rules reads ``box.`` as one)
            fork._notes = snap.warnings
            if forget is not None:  # a generated snapshot serves these forks alone
                fork._after_close.append(forget)
        started = await asyncio.gather(*(b.start() for b in boxes), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(b.aclose() for b in boxes), return_exceptions=True)
            raise failed[0]
        return boxes

    @classmethod
    def restore(
        cls,
        snapshot: str,
        policy: Policy | None = None,
        *,
        workspace: str | os.PathLike[str] | None = None,
    ) -> Sandbox:
        """A sandbox (not started) on a :meth:`snapshot`: ``policy`` (default: the default
        policy) with its image replaced by the snapshot's ref. Without a ``workspace``, a
        snapshot that kept its box's workspace gives the new box a copy of it (a workspace
        given is used as it is)."""
        base = policy if policy is not None else Policy()
        return cls(base.model_copy(update={"image": str(snapshot)}), workspace=workspace)

    async def export_root(self, dest: str | os.PathLike[str]) -> int:
        """Write what the box changed in its writable root on an image (the overlay's upper
        layer: new and changed files, deletions as whiteouts) to ``dest`` as an OCI layer
        tar, with the box's own ids; returns the number of entries. ``ImageStore.commit``
        puts such a layer on top of the image. The box keeps running: what changes while it
        is read may or may not be in the layer. ``dest`` may not lie where the box writes
        (a PolicyError), and is written as a regular file only (mode 0600 when new)."""
        box = self._box
        if box is None:
            raise errors.SandboxClosed("the sandbox is not started")
        layer = box.root_layer
        if layer is None:
            raise _invalid(
                "this box has no writable root: start it on an image (policy.image) with "
                "filesystem.root_size set, on the bwrap backend"
            )

        assert self.workspace is not None
        areas = writable_areas(self.policy, self.workspace)

        def write() -> int:
            from corral.backends.host.safepath import open_regular
            from corral.images.export import write_layer

            # Written by this (often root) process: never where the box could plant a link.
            refuse_inside("export_root's destination", Path(os.path.abspath(dest)), areas)

            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            with open(open_regular(dest, flags, 0o600), "wb") as out:
                return write_layer(layer.upper, out, layer.box_id, layer.mount_points)

        return await blocking(write)

    def _env(self) -> dict[str, str]:
        image = self.image_config
        env = box_env(self.policy, image_env=image.env if image else None)
        if self.user == "root" and "HOME" not in self.policy.env:
            env["HOME"], env["USER"] = "/root", "root"
        return env

    @property
    def default_cwd(self) -> str:
        """Where commands run without a ``cwd``: the image's ``WorkingDir`` when the policy
        leaves ``workdir`` at its default (the workspace is mounted at ``/workspace``
        still), else the policy's ``workdir``."""
        image = self.image_config
        if image is not None and image.workdir and self.policy.workdir == DEFAULT_WORKDIR:
            return posixpath.normpath(posixpath.join("/", image.workdir))
        return self.policy.workdir

    def _cwd(self, cwd: str | None) -> str:
        if cwd is None:
            return self.default_cwd
        if "\0" in cwd:
            raise _invalid(f"a NUL byte in the working directory {cwd!r}")
        return posixpath.normpath(posixpath.join(self.default_cwd, cwd))

    async def run(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        rlimits: dict[RlimitName, int] | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Run a command to completion. On timeout it is ended (SIGTERM to its process group,
        SIGKILL after ``limits.kill_grace_secs``) and the output produced so far is kept
        (``timed_out=True``). Cancelling the call ends the command the same way, waits for
        that, then lets the cancellation through: nothing of it is left in the box."""
        timeout = checked_timeout(timeout)
        timeout = timeout if timeout is not None else self.policy.limits.exec_timeout_secs
        oom_before = self.oom_kills()
        pids_before = self._pids_limit_hits()
        refusals_before = self._network.refusal_count if self._network is not None else 0
        try:
            proc = await self.spawn(cmd, cwd=cwd, env=env, stdin=stdin, rlimits=rlimits)
        except (errors.CommandNotFound, errors.NotExecutable) as exc:
            # As a shell reports it: a result with 127 / 126 and the reason on stderr.
            status = 127 if isinstance(exc, errors.CommandNotFound) else 126
            result = CommandResult(
                exit_code=status,
                stdout="",
                stderr=exc.message + "\n",
                timed_out=False,
                duration=0.0,
                truncated=False,
                pid=0,
                timeout=timeout,
                ended="not_started",
            )
            if check:
                raise errors.CommandFailed(
                    f"command {to_argv(cmd)!r} did not start: {exc.message}", result
                ) from None
            return result
        waited = await proc.wait(timeout)
        if waited.status == "timeout":
            proc.timed_out = True
            with contextlib.suppress(errors.SandboxError):
                await proc.terminate()
        oom_killed = self.oom_kills() > oom_before
        ended = proc.ended or "lost"
        if oom_killed and ended == "signalled" and proc.exit_code == -signal.SIGKILL:
            ended = "oom_killed"
        result = CommandResult(
            exit_code=proc.exit_code if proc.exit_code is not None else -9,
            stdout=proc.output("stdout"),
            stderr=proc.output("stderr"),
            timed_out=proc.timed_out,
            duration=proc.duration or 0.0,
            truncated=proc.truncated,
            pid=proc.pid,
            oom_killed=oom_killed,
            pids_limited=self._pids_limit_hits() > pids_before,
            network_refusals=(
                self._network.refusals_since(refusals_before) if self._network is not None else ()
            ),
            timeout=timeout,
            ended=ended,
        )
        if check and not result.ok:
            why = "timed out" if result.timed_out else f"exited with status {result.exit_code}"
            raise errors.CommandFailed(f"command {proc.command!r} {why}", result)
        return result

    def network_refusals(self) -> tuple[NetworkRefusal, ...]:
        """Connections the egress proxy refused in this box so far (the most recent ones)."""
        return self._network.refusals_since(0) if self._network is not None else ()

    def oom_kills(self) -> int:
        """Processes the box's memory limit killed so far: one counter read, far cheaper
        than :meth:`stats` (0 before start and after close)."""
        return self._box.oom_kills() if self._box is not None else 0

    def _pids_limit_hits(self) -> int:
        """Forks the box's pids limit refused so far (one file read where the box can)."""
        return self._box.pids_limit_hits() if self._box is not None else 0

    def process(self, pid: int) -> Process:
        """The handle of a tracked process (ProcessNotFound if unknown)."""
        return self._registry.get(pid)

    def processes(self) -> list[ProcessInfo]:
        """Running processes and the most recent finished ones."""
        return [p.info() for p in self._registry.list()]

    @property
    def registry(self) -> ProcessRegistry:
        return self._registry

    async def shell(
        self,
        shell: str = "/bin/sh",
        *,
        env: dict[str, str] | None = None,
        cols: int = 80,
        rows: int = 24,
        strip_ansi: bool = False,
        cwd: str | None = None,
        shared: bool = False,
    ) -> PtySession:
        """Open an interactive shell on a terminal; it lives until closed or the sandbox is.

        ``shared=True`` makes it attachable at once (see :meth:`share`).
        """
        proc = await self.spawn(
            shlex.split(shell), cwd=cwd, env=env, pty=True, cols=cols, rows=rows
        )
        session = await self._sessions.open(
            proc, shell, self._request, cols=cols, rows=rows, strip_ansi=strip_ansi
        )
        if shared:
            await self.share(session)
        return session

    async def share(self, session: PtySession) -> Path:
        """Let a human join ``session`` with ``corral attach`` until it closes.

        This process starts serving its shared sessions on a private unix socket (0600,
        same user only) and returns its path; unshared sessions open no socket at all.
        """
        from corral.sessions import attach

        return await attach.offer(self._sessions.get(session.session_id))

    # ---- the caller's own terminal (the spec's interactive attach) ------------------------
    async def attach(
        self,
        command: Command,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """Run ``command`` on a terminal in the box and bridge this process's own terminal
        to it (raw mode, window size and its changes, every key but the detach sequence),
        until the program exits or you type ``detach_keys`` (docker syntax: ``ctrl-q``,
        ``ctrl-p,ctrl-q``; default ``ctrl-]``).

        Returns an :class:`AttachOutcome`: ``exit_code`` once the program exits; when you
        detach, ``detached`` and the ``session_id`` it keeps running under: :meth:`reattach`
        it, or ``corral attach ID`` from another terminal while this process runs. A string
        command is split into words (no shell syntax); a list is the argv. ``stdin`` and
        ``stdout`` are the terminal's file descriptors; input that is not a terminal is
        forwarded as it is, and its end detaches."""
        keys = parse_detach_keys(detach_keys)
        check_input(stdin)
        line = command if isinstance(command, str) else shlex.join(to_argv(command))
        if not line.strip():
            raise _invalid("empty command")
        cols, rows = window_size(stdout)
        session = await self.shell(line, env=env, cwd=cwd, cols=cols, rows=rows)
        return await self._bridge(session, keys, stdin, stdout)

    async def attach_shell(
        self,
        shell: str | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """:meth:`attach` to a shell: ``shell``, else bash when the box has it, else
        ``/bin/sh``."""
        parse_detach_keys(detach_keys)  # before anything starts
        check_input(stdin)
        shell = shell or await default_shell(self.run)
        return await self.attach(
            shell, env=env, cwd=cwd, detach_keys=detach_keys, stdin=stdin, stdout=stdout
        )

    async def reattach(
        self,
        session: PtySession | str,
        *,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """Bridge this process's terminal to a running session of this sandbox (one you
        detached from, or any :meth:`shell`), by the session or its id; see :meth:`attach`."""
        keys = parse_detach_keys(detach_keys)
        check_input(stdin)
        found = self._sessions.get(session if isinstance(session, str) else session.session_id)
        return await self._bridge(found, keys, stdin, stdout)

    async def _bridge(
        self, session: PtySession, keys: bytes, stdin: int, stdout: int
    ) -> AttachOutcome:
        server = await self.share(session)
        outcome = await attach_terminal(
            server, session.session_id, detach_keys=keys, in_fd=stdin, out_fd=stdout
        )
        if outcome.reason == "exited" and outcome.exit_code is None:
            code = await session.wait_closed()
            return dataclasses.replace(outcome, exit_code=code)
        return outcome

    def session(self, session_id: str) -> PtySession:
        """An open session by id (SessionNotFound if unknown or closed)."""
        return self._sessions.get(session_id)

    def sessions(self) -> list[PtySession]:
        return self._sessions.list()

    def exec_stream(
        self,
        cmd: Command,
        *,
        stdin: Literal["pipe"] | None = None,
        tty: bool = False,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PendingExecStream:
        """Stream a command's output events (Stdout, Stderr, Exited): ``async for ev in
        sb.exec_stream(...)``, ``async with sb.exec_stream(...) as stream`` or ``stream =
        await sb.exec_stream(...)``. The command starts on first use."""
        argv = to_argv(cmd)
        timeout = checked_timeout(timeout)

        async def start() -> ExecStream:
            proc = await self.spawn(argv, cwd=cwd, env=env, stdin=stdin, pty=tty)
            return ExecStream(proc, stdin=stdin == "pipe", tty=tty, timeout=timeout)

        return PendingExecStream(start, cmd if isinstance(cmd, str) else shlex.join(argv))

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self) -> None:
        """Stop every process of the box where it stands (the cgroup freezer): nothing in it
        runs, memory stays as it is, the filesystem holds still (what a snapshot wants).
        Until :meth:`resume`, requests raise :class:`SandboxPaused`; timeouts keep counting.
        :class:`BackendUnavailable` on backends without a freezer (OCI, microVM, rootless)."""
        if self._box is None or self._closed:
            raise errors.SandboxClosed("the sandbox is not running")
        if self._paused:
            return
        await self._box.freeze(True)
        self._paused = True
        self.audit.record("sandbox", event="pause")

    async def resume(self) -> None:
        """Let a paused box run again."""
        if self._box is None or self._closed or not self._paused:
            return
        await self._box.freeze(False)
        self._paused = False
        self.audit.record("sandbox", event="resume")

    async def info(self) -> dict[str, Any]:
        """Kernel, hostname, cpus, memory of the box, plus its backend and limits, and its
        published ports (``"published": ["127.0.0.1:41234->8000/tcp"]``) when it has any.
        ``"landlock"``: ``{"abi": 7, "enforced": True, ...}``, or why it is not enforced
        (``security.landlock``). ``"user"``: who commands run as (``user`` or ``root``);
        ``"image"`` (a box on an image): its ref, digest, whether its root is writable and
        the default cwd."""
        reply, _ = await self._request("info")
        reply.pop("re", None)
        assert self._box is not None
        info = {**reply, **self._box.describe(), "workspace": str(self.workspace)}
        info["user"] = self.user
        if self.policy.image != "host":
            info["image"] = {
                "ref": self.policy.image,
                "digest": self.image_config.digest if self.image_config else None,
                # Every backend that runs images makes the root writable when it has a size
                # (a rootless box's upper lives in its own namespace: no root_layer then).
                "writable": self.policy.filesystem.root_size is not None,
                "cwd": self.default_cwd,
            }
        if self.published:
            info["published"] = [str(p) for p in self.published]
        return info

    def stats(self) -> BoxStats:
        """Resource use of the whole box (from its cgroup)."""
        if self._box is None:
            raise errors.SandboxClosed("the sandbox is not started")
        return self._box.stats()


def _end_orphan(started: asyncio.Future[Any], holder: list[Process]) -> None:
    """A spawn whose caller was cancelled: end the command if it started after all."""
    if started.cancelled() or started.exception() is not None:
        return
    end_in_background(holder[0])
