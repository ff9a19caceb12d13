"""The bubblewrap backend: namespaces, seccomp, a per-box cgroup, and the guest agent.

Start-up sequence (bwrap is blocked until step 5 and again until step 7, so it never runs
with its own uid map, and no process of the box but bwrap itself building the mounts ever
runs outside its cgroup)::

    1. socketpair (host end = channel), pipes for --info-fd, --userns-block-fd, --block-fd,
       --seccomp; start the RCU grace period the cgroup move waits for (in a thread)
    2. spawn bwrap as the box's own unprivileged host uid (its namespace owner, from
       :func:`corral.backends.host.ucounts.claim_owner`), no supplementary groups
    3. read the child pid from --info-fd
    4. write the child's uid_map/gid_map: box root -> that owner uid, the other box ids ->
       an unprivileged host uid range, box uid 1000 (commands) -> the workspace owner, so
       files written in the workspace belong to its owner on the host; mount the box's own
       devpts in its mount namespace
    5. release --userns-block-fd: bwrap builds the mounts, then waits on --block-fd
    6. move the child (still one process) into the box's cgroup, once the grace period passed
    7. release --block-fd: bwrap installs the seccomp filter and execs the guest agent

A state directory per box records the owner's pid; boxes whose owner died (SIGKILL) are swept
by the first start of a process (in a thread): bwrap is killed, the cgroup and the state
directory removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from corral.backends.base import (
    AGENT_DIR,
    BackendBase,
    BoxSpec,
    CgroupBox,
    RootLayer,
    agent_config,
    channel_pair,
    kill_if_named,
    sweep_boxes,
)
from corral.backends.bwrap import args as bwrap_args
from corral.backends.host import (
    cgroups,
    devpts,
    dropids,
    idmap,
    maskfollow,
    overlay,
    safepath,
    seccomp,
    staging,
    ucounts,
)
from corral.backends.host.boxfiles import shared_files
from corral.backends.host.child import HostChild, adopt, read_until, watch
from corral.backends.host.python import (
    HiddenPython,
    ensure_agent_compiled,
    find_python,
    hidden_python,
)
from corral.backends.host.state import BOX_PREFIX, state_root, write_owner
from corral.backends.host.threads import blocking, in_new_thread
from corral.backends.landlock import rules as landlock_rules
from corral.backends.layout import (
    SYSTEM_PATH,
    Bind,
    unplaceable_mount,
    writable_areas,
)
from corral.backends.limits import LimitPlan, plan_limits
from corral.backends.users import HOST_UID_BASE, id_map, id_ranges, own_block
from corral.errors import BackendError, BackendUnavailable, ImageError, PolicyError
from corral.policy import DEFAULT_WORKDIR, Policy

START_TIMEOUT = 10.0


def sweep_orphans(support: cgroups.CgroupSupport | None = None) -> list[str]:
    """Remove what boxes of dead owners left behind (after a SIGKILL of the host process)."""
    boxes = state_root() / "boxes"
    removed = sweep_boxes(
        "bwrap", lambda _, owner: kill_if_named(int(owner.get("bwrap_pid", 0) or 0), "bwrap")
    )
    # Workspaces a dead pool had bound into its boxes (mounts in the host's namespace).
    staging.sweep_staging()
    # A box's cgroup whose state directory is gone belongs to nobody. Only box names are
    # considered: other users of the corral/ parent (tests, other tools) are not ours.
    with contextlib.suppress(BackendError):
        cgroups.sweep_orphans(
            lambda name: not name.startswith(BOX_PREFIX) or (boxes / name).exists(), support
        )
    return removed


INFO_LIMIT = 1 << 16
"""bwrap's --info-fd JSON is a few dozen bytes; more is not bwrap's."""


async def _read_info(fd: int, proc: HostChild) -> dict[str, Any]:
    """Read bwrap's --info-fd JSON (written once the namespaces exist); closes ``fd``."""
    os.set_blocking(fd, False)
    try:
        async with asyncio.timeout(START_TIMEOUT):
            data = await read_until(fd, lambda got: b"}" in got, INFO_LIMIT)
    finally:
        os.close(fd)
    if b"}" not in data:
        raise BackendError(f"bwrap failed to start the box: {await proc.stderr()}")
    return dict(json.loads(data[: data.index(b"}") + 1]))


def _pins(
    binds: list[tuple[str, str]],
    in_area: Callable[[str], str | None],
    areas: list[str],
) -> list[safepath.Pinned]:
    """The object each bind *at* a path inside a writable area's guest directory (a mask, a
    nested share) must show once bwrap has built the box. bwrap mounts sources from the fds
    the host opened, but resolves destinations by path in the new root: a link a box on the
    same workspace swapped in meanwhile would move a mask off what it hides.
    :meth:`BwrapBox.check_layout` compares before the box runs anything."""
    writable = [dest for source, dest in binds if in_area(source) is not None]
    last = {dest: i for i, (_, dest) in enumerate(binds)}
    pins: list[safepath.Pinned] = []
    for i, (source, dest) in enumerate(binds):
        if last[dest] != i or not any(
            d != dest and dest.startswith(d.rstrip("/") + "/") for d in writable
        ):
            continue
        try:
            pins.append(safepath.pin(dest, source, areas))
        except OSError as exc:
            raise PolicyError(
                f"{source} lies in a writable area and cannot be opened without following "
                f"a link ({exc.strerror}; made by a box?): remove the link"
            ) from None
    return pins


@dataclass
class _Held:
    """What a starting box holds on the host, as soon as each part exists."""

    shared: idmap.SharedPaths | None = None
    cgroup: cgroups.Cgroup | None = None
    warnings: list[str] = field(default_factory=list)
    args_fd: int = -1
    """bwrap's options (a memfd read through ``--args``), closed once bwrap has it."""
    owner: ucounts.BoxOwner | None = None
    """The host uid that owns (creates) the box's user namespace; bwrap runs as it."""
    primed: concurrent.futures.Future[None] | None = None
    """:func:`cgroups.prime_migration` running in a thread (the move waits for it)."""
    root_layer: RootLayer | None = None
    """The upper of the box's writable root on an image (:mod:`.overlay`), if any."""
    bind_fds: list[int] = field(default_factory=list)
    """Bind sources in writable areas, opened safely (``--bind-fd``), closed once bwrap runs."""
    pins: list[safepath.Pinned] = field(default_factory=list)
    """What the box must show at each bind inside a writable area (checked once it is up)."""

    def close_bind_fds(self) -> None:
        for fd in self.bind_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.bind_fds.clear()

    def release(self, spec: BoxSpec) -> None:
        """Undo a failed start (blocking): the cgroup, the idmapped mounts, the state dir."""
        if self.cgroup is not None:
            with contextlib.suppress(BackendError):
                self.cgroup.remove()
        if self.shared is not None:
            self.shared.release()
        self.close_bind_fds()
        shutil.rmtree(spec.state_dir, ignore_errors=True)
        if self.owner is not None:
            self.owner.release()


def _setup_box_ids(spec: BoxSpec, child: int, uid: int, gid: int, root: int, others: int) -> None:
    """Write the box's id maps (box root -> ``root``, the namespace's owner).

    Three small writes to procfs, each whole in one ``write`` (as the kernel wants a map),
    through one descriptor of the child's /proc directory: cheaper than a thread hop, or
    than pathlib (~30 us a file here). bwrap waits for them; the owner record for the
    orphan sweep is written once it runs on (:meth:`BwrapBackend.start`).

    ``setgroups`` stays allowed where commands are box root: apt and other tools that drop
    to a user of their own call it. bwrap starts with no supplementary group, so there is
    none a process could shed to escape a group's negative permissions, and only the box's
    own (mapped) groups can be taken."""
    setgroups = "allow" if spec.user == "root" else "deny"
    proc = os.open(f"/proc/{child}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # setgroups before gid_map: the kernel takes no "deny" once a gid map is written.
        for name, text in (
            ("uid_map", id_map(uid, root, others)),
            ("setgroups", setgroups),
            ("gid_map", id_map(gid, root, others)),
        ):
            fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=proc)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
    finally:
        os.close(proc)


def _other_ids(spec: BoxSpec, owner: int) -> int:
    """Where the box's ids but 0 and 1000 start on the host: a block of its own when its
    commands are box root (:func:`corral.backends.users.own_block`), else the shared range."""
    return own_block(owner) if spec.user == "root" else HOST_UID_BASE


class BwrapBox(CgroupBox):
    backend = "bwrap"

    def __init__(
        self,
        spec: BoxSpec,
        proc: HostChild,
        channel: socket.socket,
        cgroup: cgroups.Cgroup | None,
        warnings: tuple[str, ...],
        limits: LimitPlan,
        shared: idmap.SharedPaths | None = None,
        owner: ucounts.BoxOwner | None = None,
        root_layer: RootLayer | None = None,
        pins: tuple[int, list[safepath.Pinned]] = (0, []),
    ) -> None:
        super().__init__(spec, channel, warnings, limits)
        self.root_layer = root_layer
        self._proc = proc
        proc.reap_on_exit()  # bwrap ends when the agent dies: no zombie until close
        self._cgroup = cgroup
        self._own_pids = limits.own_pids
        self._shared = shared
        if shared is not None:
            self.user_ids = (shared.uid, shared.gid)
        self._owner = owner
        self._pins = pins
        """bwrap's child (pid 1 of the box) and what it must show at paths in writable areas."""

    def check_layout(self) -> None:
        """Refuse the box (PolicyError) if a bind inside a writable area is not the object
        the host pinned: bwrap resolved its destination by path. The agent is ready, so
        bwrap has built every mount; it has run nothing yet."""
        pid, pins = self._pins
        if pins:
            safepath.check_pins(pid, pins)

    async def diagnose(self) -> str:
        """What bwrap said, when the box died before its agent was ready."""
        return await self._proc.stderr()

    def stop(self) -> None:
        if self._cgroup is not None:
            with contextlib.suppress(Exception):
                self._cgroup.kill_all(wait=False)
        self._proc.kill()

    async def _teardown(self) -> None:
        if self._cgroup is not None:
            with contextlib.suppress(Exception):
                await self._cgroup.kill_all_async()
        self._proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._proc.wait()
        self._proc.close()
        await self._release_host(self._cgroup, self._shared, self._owner)


class BwrapBackend(BackendBase):
    name = "bwrap"

    _found: ClassVar[BwrapBackend | None] = None
    _finding: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def for_policy(cls, policy: Policy) -> BwrapBackend:
        # One per process: what it finds (bwrap, setpriv, the cgroup layout, the interpreter)
        # does not change while it runs, and finding it again cost ~1 ms of every start.
        # Under a lock: concurrent first starts each made one, and a dropped one's spawner
        # thread (SpawnInside) exited with it; bwrap's --die-with-parent follows the thread
        # that started it, so every box that thread had started was SIGKILLed.
        found = cls._found
        if found is None:
            with cls._finding:
                found = cls._found
                if found is None:
                    found = cls._found = cls()
        return found

    def __init__(self) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise BackendUnavailable(
                "bubblewrap (bwrap) is not installed; install it with `apt-get install bubblewrap`"
                " or run `corral doctor`"
            )
        if os.geteuid() != 0:
            raise BackendUnavailable(
                "the bwrap backend needs root on the host to map the box's users and cgroups; "
                "run corral as root (or use a rootless backend when available)"
            )
        ucounts.lift_msgqueue_limit()  # bwrap, as this uid, owns every box's user namespace
        self.cgroup_support = cgroups.detect()
        # On cgroup v1 bwrap is started from inside the box's cgroup (no move, no grace
        # period): its outer monitor and its init (pid 1 of the box) sit in the box's cgroup
        # beside the agent; otherwise only the init, moved there before it forks.
        self.spawn_inside = cgroups.SpawnInside(self.cgroup_support)
        own = 2 if self.spawn_inside.unusable is None else 1
        self.limit_caps = cgroups.limit_capabilities(self.cgroup_support, own_pids=own)
        self.python = find_python()
        # bwrap starts as the unprivileged uid box root maps to (the box's own namespace
        # owner). A small program switches to it in the exec'd process, so Python can vfork:
        # forking this (large) process to call setuid in the child costs 3-6 ms of a start.
        self.drop_ids = dropids.as_uid
        self.devpts = devpts.mount_point()

    def sweep_orphans(self) -> list[str]:
        removed = sweep_orphans(self.cgroup_support)
        ucounts.sweep_free_slots()  # what a dead owner's box left running as its uids
        return removed

    async def start(self, spec: BoxSpec) -> BwrapBox:
        policy = spec.policy
        await self.prepare()
        await ensure_agent_compiled(AGENT_DIR, self.python)
        problem = unplaceable_mount(policy)
        if problem is not None:
            raise PolicyError(problem)
        limits = plan_limits(policy.limits, self.limit_caps)
        held = _Held()
        host_end, guest_end = channel_pair()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        setup_r, setup_w = os.pipe()
        sec_r, sec_w = os.pipe()
        fds = bwrap_args.BwrapFds(info=info_w, userns_block=block_r, seccomp=sec_r, block=setup_r)
        proc: HostChild | None = None
        primed: asyncio.Future[None] | None = None
        try:
            # Directories, the seccomp filter, idmapped mounts, argv and the cgroup, in a
            # thread: mount and cgroup v1 calls wait for RCU grace periods.
            argv = await blocking(
                self._prepare_box, spec, limits, held, fds, sec_w, guest_end.fileno()
            )
            sec_w = -1
            cgroup, shared, owner = held.cgroup, held.shared, held.owner
            assert shared is not None and owner is not None
            if held.primed is not None:
                primed = asyncio.wrap_future(held.primed)
            pass_fds = (guest_end.fileno(), info_w, block_r, setup_r, sec_r, held.args_fd)
            proc = await self._spawn_into(cgroup, argv, (*pass_fds, *held.bind_fds), owner.uid)
            held.close_bind_fds()  # bwrap has its copies; it mounts from them
            for fd in (held.args_fd, info_w, block_r, setup_r, sec_r):
                os.close(fd)
            held.args_fd = info_w = block_r = setup_r = sec_r = -1
            fd, info_r = info_r, -1
            info = await _read_info(fd, proc)
            child = int(info["child-pid"])
            # The devpts mount (in its own thread) needs no id map: it runs meanwhile.
            pts = asyncio.wrap_future(devpts.submit_mount(child, self.devpts))
            try:
                others = _other_ids(spec, owner.uid)
                _setup_box_ids(spec, child, shared.uid, shared.gid, owner.uid, others)
            except BaseException:
                with contextlib.suppress(BaseException):
                    await pts  # never left running past the start
                raise
            await pts
            net = spec.network
            if net is not None and net.needs_attach:
                await net.attach(child)  # full mode: fence and connect the netns first
            os.write(block_w, b"1")  # bwrap builds the box's mounts now
            # Meanwhile, off bwrap's path: who owns the box, for the orphan sweep (a state
            # dir a SIGKILLed host left without it is swept once a minute old, and bwrap has
            # died with its parent by then).
            write_owner(spec.state_dir, "bwrap", bwrap_pid=proc.pid)
            if cgroup is not None and not self.spawn_inside.holds(cgroup, child):
                # bwrap (the box's pid 1 to be) is one process, waiting on --block-fd with
                # the mounts built: every process of the box descends from it, and it forks
                # the first only once released. The move takes ~0.1 ms once the primed
                # grace period is over. bwrap's outer monitor only waits.
                if primed is not None:
                    await primed
                await self._add_to_cgroup(cgroup, child, proc)
            os.write(setup_w, b"1")
        except BaseException:
            if held.primed is not None and not held.primed.done():
                with contextlib.suppress(BaseException):
                    # A short write, never an error: no thread outlives start.
                    await (primed or asyncio.wrap_future(held.primed))
            if proc is not None:
                proc.kill()
                await proc.wait()
                proc.close()
            host_end.close()
            await blocking(held.release, spec)
            raise
        finally:
            guest_end.close()
            for fd in (info_r, info_w, block_r, block_w, setup_r, setup_w, sec_r, sec_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if held.args_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(held.args_fd)
        host_end.setblocking(False)
        return BwrapBox(
            spec,
            proc,
            host_end,
            cgroup,
            tuple(held.warnings),
            limits,
            shared,
            owner,
            held.root_layer,
            (child, held.pins),
        )

    @staticmethod
    async def _add_to_cgroup(cgroup: cgroups.Cgroup, child: int, proc: HostChild) -> None:
        """Move bwrap's child into the box's cgroup; if it is gone, bwrap failed while it
        built the mounts, and its own error says why."""
        try:
            cgroup.add(child)
        except BackendError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, OSError) and cause.errno == errno.ESRCH):
                raise
            detail = await proc.stderr()
            if not detail:
                raise
            raise BackendError(f"bwrap failed to start the box: {detail}") from None

    def _prepare_box(
        self,
        spec: BoxSpec,
        limits: LimitPlan,
        held: _Held,
        fds: bwrap_args.BwrapFds,
        sec_w: int,
        channel_fd: int,
    ) -> list[str]:
        """Everything of a start that happens before bwrap runs; what it makes goes into
        ``held`` as soon as it exists (the caller releases it on failure). Blocking."""
        policy = spec.policy
        try:
            os.write(sec_w, seccomp.build_filter(policy.security.preset))
        finally:
            os.close(sec_w)
        # The state directory before the cgroup: an orphan sweep (any corral process) removes
        # a box's cgroup that has none.
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        # The cgroup next: the prime below holds cgroupfs for its grace period (~8 ms here),
        # which then passes while the rest is prepared, bwrap starts and builds the mounts.
        held.cgroup, held.warnings = self._make_cgroup(spec, limits)
        if held.cgroup is not None and self.spawn_inside.unusable is not None:
            started = threading.Event()
            held.primed = in_new_thread(cgroups.prime_migration, self.cgroup_support, started)
            # Until the prime's thread is in its write (GIL released): this thread's Python
            # work below would otherwise hold it back by a millisecond or more.
            started.wait(0.05)
        masked_file, masked_dir, passwd = shared_files()
        held.owner = owner = ucounts.claim_owner()
        devpts.refuse_beyond_pool(owner.slot)  # its max= must fit beside the others'
        if spec.user == "root":
            # Box root's commands own the shared paths: their owner's files appear as box
            # root's (the namespace owner's host uid); box uid 1000 keeps its own host id.
            held.shared = shared = idmap.share_paths(spec, user=owner.uid)
            if shared.binds is not None or spec.workspace_prepared:
                shared.uid = shared.gid = owner.command_id
        else:
            held.shared = shared = idmap.share_paths(spec, user=owner.command_id)
        ids = {"uid": 0, "gid": 0} if spec.user == "root" else {}
        config = {**agent_config(spec, **ids), "fd": channel_fd}
        if spec.user == "root":
            # Commands share the agent's uid: only this keeps them out of its /proc/PID/fd
            # (the channel to the host), environ and memory (they hold no CAP_SYS_PTRACE).
            config["undumpable"] = True
        net = spec.network
        image, hidden = self._image(spec, held)
        image_root = None if image is None else image.root
        config["landlock"] = landlock_rules(
            policy,
            self.python,
            [g for _, g in net.binds()] if net else (),
            deferred=spec.workspace_prepared,
            image_top=None if image_root is None else overlay.image_dirs(image_root),
            image_writable=image is not None and image.upper is not None,
        )
        if net is not None:
            config["forwarders"] = net.forwarders()
            config["publishers"] = net.publishers_config()
            # The box user's group may be the owner's; pasta joins as the namespace owner.
            net.admit(owner.uid, shared.gid, namespace_owner=owner.uid)
        inputs = bwrap_args.BwrapInputs(
            workspace=shared.workspace,
            agent_dir=AGENT_DIR,
            python=self.python,
            masked_file=masked_file,
            masked_dir=masked_dir,
            passwd_file=passwd,
            fds=fds,
            agent_args=(json.dumps(config, separators=(",", ":")),),
            extra_binds=tuple(Bind(h, g) for h, g in net.binds()) if net else (),
            sources=shared.sources,
            devpts=self.devpts,
            image_root=image_root,
            image_writable=image is not None and image.upper is not None,
            hidden=hidden,
            root_commands=spec.user == "root",
            workspace_host_path=None if spec.workspace_prepared else str(spec.workspace),
        )
        make = safepath.placeholder_maker(spec.workspace, shared.workspace, shared.sources)
        argv = bwrap_args.bwrap_argv(
            policy, inputs, maskfollow.host_view(policy, spec.workspace, make)
        )
        argv = self._binds_by_fd(spec, shared, argv, held)
        argv[0] = self.bwrap or "bwrap"
        if image_root is not None:
            writable = held.root_layer is not None
            link = bwrap_args.image_link_in_the_way(argv, image_root, writable)
            if link is not None:
                raise ImageError(
                    f"policy.image {policy.image!r}: {link} passes through a symbolic link "
                    "of the image, where corral mounts the box's own; corral does not follow "
                    "an image's links on the host (make it a directory in the image)"
                )
        if held.root_layer is not None and image_root is not None:
            made = bwrap_args.placeholders(argv, image_root)
            held.root_layer = dataclasses.replace(held.root_layer, mount_points=made)
        argv, options = bwrap_args.hide_options(argv)
        held.args_fd = os.memfd_create("corral-bwrap-args", os.MFD_CLOEXEC)
        os.write(held.args_fd, options)  # a memfd takes any size whole: no partial write
        os.lseek(held.args_fd, 0, os.SEEK_SET)
        argv[2] = str(held.args_fd)
        if shared.warning:
            held.warnings.append(shared.warning)
        return argv

    def _image(
        self, spec: BoxSpec, held: _Held
    ) -> tuple[overlay.ImageRoot | None, HiddenPython | None]:
        """The root of ``policy.image`` (None: the host's system) and how the agent's
        interpreter runs beside it. The image is mounted idmapped with the box's own id maps
        under a per-box overlay (``filesystem.root_size``; :mod:`.overlay`), at a staging
        mount point only bwrap (the box's owner uid) can reach, released with the box's
        shared paths. Blocking (a registry ref may be pulled)."""
        policy = spec.policy
        if policy.image == "host":
            return None, None
        from corral.images import resolve_root

        image = resolve_root(policy.image, cow=policy.filesystem.root_size is not None)
        if image is None or image.rootfs is None:
            return None, None
        hidden = hidden_python(self.python)
        shared, owner = held.shared, held.owner
        assert shared is not None and owner is not None
        if shared.binds is None:
            shared.binds = idmap.IdmappedBinds(spec.sandbox_id)
        root = overlay.mount_image_root(
            spec.sandbox_id,
            image.rootfs,
            shared.binds.entries,
            uids=id_ranges(shared.uid, owner.uid, _other_ids(spec, owner.uid)),
            gids=id_ranges(shared.gid, owner.uid, _other_ids(spec, owner.uid)),
            owner=owner.uid,
            size=policy.filesystem.root_size,
            # The image's WorkingDir is the default cwd: made as Docker makes a WORKDIR.
            workdir=image.config.workdir if policy.workdir == DEFAULT_WORKDIR else None,
            seed=image.cow,
            release=shared.binds.after,
        )
        if root.upper is not None:
            ids = id_ranges(shared.uid, owner.uid, _other_ids(spec, owner.uid))
            held.root_layer = RootLayer(root.upper, tuple(ids), subvolume=root.subvolume)
        return root, hidden

    @staticmethod
    def _binds_by_fd(
        spec: BoxSpec, shared: idmap.SharedPaths, argv: list[str], held: _Held
    ) -> list[str]:
        """Open every bind source that lies in a writable area (the workspace, ``allow_write``,
        rw mounts, and their idmapped mount points) beneath that area without following any
        symlink, and have bwrap mount it from the descriptor: a box running on the same
        workspace cannot swap the path between the host's checks and bwrap's mount."""
        areas = [
            *writable_areas(spec.policy, spec.workspace),
            str(shared.workspace),
            *shared.sources.values(),
        ]
        fds: dict[str, int] = {}
        in_area = safepath.area_finder(areas)
        held.pins = _pins(bwrap_args.binds(argv), in_area, areas)
        for source in bwrap_args.bind_sources(argv):
            if source in fds or in_area(source) is None:
                continue
            try:
                fds[source] = fd = safepath.open_path(source, os.O_PATH, areas)
            except OSError as exc:
                raise PolicyError(
                    f"{source} lies in a writable area and cannot be opened without following "
                    f"a link ({exc.strerror}; made by a box?): remove the link"
                ) from None
            held.bind_fds.append(fd)
        return bwrap_args.binds_by_fd(argv, fds)

    async def _spawn_into(
        self,
        cgroup: cgroups.Cgroup | None,
        argv: list[str],
        pass_fds: tuple[int, ...],
        uid: int,
    ) -> HostChild:
        """bwrap born inside the box's cgroup where the host allows it, else spawned here
        (and moved in later, once it has built the mounts)."""
        if cgroup is not None and self.spawn_inside.unusable is None:
            return await self._spawn_inside(cgroup, argv, pass_fds, uid)
        return self._spawn(argv, pass_fds, uid)

    async def _spawn_inside(
        self, cgroup: cgroups.Cgroup, argv: list[str], pass_fds: tuple[int, ...], uid: int
    ) -> HostChild:
        """:meth:`_spawn` from a host thread that is in the box's cgroup meanwhile, so that
        bwrap and everything it forks are born there (see :class:`cgroups.SpawnInside`);
        the usual spawn (and a move later) when that thread could not enter."""
        done = self.spawn_inside.submit(cgroup, lambda: self._popen(argv, pass_fds, uid))
        try:
            return await adopt(done)
        except OSError:  # the thread could not enter the group: nothing was started
            return self._spawn(argv, pass_fds, uid)

    def _spawn(self, argv: list[str], pass_fds: tuple[int, ...], uid: int) -> HostChild:
        return watch(self._popen(argv, pass_fds, uid))

    def _popen(
        self, argv: list[str], pass_fds: tuple[int, ...], uid: int
    ) -> subprocess.Popen[bytes]:
        """Start bwrap as the unprivileged host uid that box root maps to (the box's own
        namespace owner), so neither bwrap's own init nor the agent is host root, even for
        a moment."""
        drop: dict[str, Any] = {}
        as_box_root = self.drop_ids(uid)
        if as_box_root is None:  # Python switches users in a forked child: slower, the same
            as_box_root = ()
            drop = {"user": uid, "group": uid, "extra_groups": []}
        return subprocess.Popen(
            [*as_box_root, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            # No LANG: unshare would load the locale (~0.4 ms of CPU on every start); the
            # agent gets its LANG from bwrap's --setenv (args.bwrap_argv).
            env={"PATH": SYSTEM_PATH},
            start_new_session=True,
            **drop,
        )

    def _make_cgroup(
        self, spec: BoxSpec, plan: LimitPlan
    ) -> tuple[cgroups.Cgroup | None, list[str]]:
        warnings = list(plan.warnings)
        if plan.mechanism == "none":
            return None, warnings
        wanted = cgroups.CgroupLimits(
            memory_bytes=plan.memory_max, cpu_quota=plan.cpu_quota, max_pids=plan.pids_max
        )
        group = cgroups.Cgroup.create(spec.sandbox_id, wanted, self.cgroup_support)
        return group, warnings + cgroups.late_unenforced(group, plan)
