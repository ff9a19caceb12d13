"""The bwrap backend for an ordinary user (rootless): ``backend="bwrap"`` when corral is not
root, and ``backend="bwrap-rootless"`` anywhere (tests run it as root too).

What changes from root mode (:mod:`corral.backends.bwrap.box`), and why:

- **ids.** bwrap runs as the user, who owns the box's user namespace. With subordinate ids
  (``/etc/subuid``, ``/etc/subgid``) and ``newuidmap``/``newgidmap`` the host maps box root
  and the other box ids onto the user's subordinate range and box uid 1000 (commands) onto
  the user (:func:`corral.backends.users.rootless_ranges`): files commands write in the
  workspace belong to the user, and the agent is an id commands cannot signal or inspect.
  bwrap's own process is then box uid 1000, so the agent takes box root itself at start
  (``become_root``: it holds CAP_SETUID/CAP_SETGID, drops the user's supplementary groups,
  and keeps no other capability). Without subordinate ids the kernel maps one id: box root is
  the user and commands run as box root too, with no capability at all (bwrap's
  ``--cap-drop ALL``); a command can then signal the agent: a warning says so.
- **limits.** No cgroup (a user cannot create one without a delegated subtree): the
  planner's ``rlimits`` fallback (RLIMIT_AS for memory, RLIMIT_NPROC for processes, the
  timeout for time; a CPU quota is not enforced) and a warning per limit.
- **no host-side mounts.** No idmapped workspace, no warm pool (its staging mounts are
  root's). The box's capped devpts (``max=``, :mod:`corral.backends.host.devpts`) is
  mounted as in root mode, while bwrap waits for its maps, but from inside the box's user
  namespace (``nsenter --user --mount ... mount -t devpts``): the user owns that namespace,
  and a thread of this process could not enter it (a process with threads may not change
  user namespace).
- **network.** every mode: the sockets of ``allowlist``, ``ports`` and published ports are
  the user's, and ``full`` runs pasta as the user, its nftables fence loaded through the
  box's user namespace (the user owns it) before the agent starts.
- **/run** is bwrap's, made as the commands' uid: remounted read-only.

Everything else is root mode's: the same bwrap options (read-only host root, masks of the
user's own credentials, private /tmp, seccomp, no new privileges), the same agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import shutil
import signal
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any, ClassVar

from corral.backends.base import (
    AGENT_DIR,
    BackendBase,
    BoxSpec,
    agent_config,
    channel_pair,
)
from corral.backends.bwrap import args as bwrap_args
from corral.backends.bwrap.box import BwrapBackend, BwrapBox, _Held, _read_info
from corral.backends.host import (
    cgroups,
    devpts,
    idmap,
    maskfollow,
    overlay,
    safepath,
    seccomp,
    subids,
)
from corral.backends.host.boxfiles import shared_files
from corral.backends.host.child import HostChild, watch
from corral.backends.host.python import (
    HOST_PREFIX,
    ensure_agent_compiled,
    find_python,
    hidden_python,
)
from corral.backends.host.state import make_private_dir, state_root, write_owner
from corral.backends.host.subids import SINGLE_ID_WARNING
from corral.backends.host.threads import blocking
from corral.backends.landlock import rules as landlock_rules
from corral.backends.layout import (
    GUEST_AGENT_DIR,
    SYSTEM_PATH,
    Bind,
    unplaceable_mount,
)
from corral.backends.limits import LimitPlan, agent_rlimits, plan_limits
from corral.backends.users import BOX_UID, rootless_ranges
from corral.errors import BackendError, BackendUnavailable, ImageError, PolicyError

PTY_UNCAPPED = (
    "rootless: the box's PTYs come from bwrap's own devpts, without a cap (kernel.pty.max is "
    "shared with the host): nsenter and mount (util-linux) are needed to cap them; as root "
    "run once: apt-get install util-linux mount"
)


def _map_argv(tool: str, pid: int, ranges: list[tuple[int, int, int]]) -> list[str]:
    return [tool, str(pid), *(str(n) for r in ranges for n in r)]


def rootless_argv(argv: list[str], mapped: bool) -> list[str]:
    """Root mode's bwrap options made a rootless box's: bwrap's own uid is box uid 1000 when
    subordinate ids are mapped (the agent takes box root itself), and with one id mapped the
    box keeps no capability at all (no second id to switch to)."""
    out: list[str] = []
    i = 0
    sealed = "--remount-ro" in argv
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg == "--seccomp" and not sealed:
            out += ["--remount-ro", "/run"]  # a writable image root: /run sealed all the same
            sealed = True
        if arg in ("--uid", "--gid") and mapped:
            out += [arg, str(BOX_UID)]
            i += 2
            continue
        if arg == "--cap-add" and not mapped:
            i += 2
            continue
        if argv[i : i + 2] == ["--remount-ro", "/"]:
            # bwrap made /run as itself: the commands' uid (1000, or box root with one id).
            # Read-only, it is what it is in root mode to them (box root's): the agent's and
            # the network's mount points cannot be moved away.
            out += ["--remount-ro", "/run"]
        if arg == "--ro-bind" and argv[i + 2 : i + 3] == [GUEST_AGENT_DIR] and mapped:
            # Its parent would be bwrap's, 0700: box root (the agent) could not enter it.
            out += ["--perms", "0755", "--dir", posixpath.dirname(GUEST_AGENT_DIR)]
        if arg == "--ro-bind" and argv[i + 2 : i + 3] == [HOST_PREFIX + "/usr"] and mapped:
            out += ["--perms", "0755", "--dir", HOST_PREFIX]  # the agent's interpreter: idem
        out.append(arg)
        i += 1
    return out


class RootlessBwrapBox(BwrapBox):
    backend = "bwrap-rootless"
    rootless: dict[str, str]
    init_fd = -1
    """A pidfd of the box's pid 1 (bwrap's child): without a cgroup to empty, the box ends
    when its pid 1 does, and :meth:`_teardown` waits for that."""

    def _facts(self) -> dict[str, Any]:
        """``info()["rootless"]``: how commands are separated from the agent, and what
        enforces the limits (the warnings say what that leaves unenforced)."""
        return {**super()._facts(), "rootless": dict(self.rootless)}

    def _kill_init(self) -> None:
        """SIGKILL the box's pid 1 (the kernel then kills every process of its pid
        namespace), besides bwrap, whose death reaches pid 1 only through its parent-death
        signal, later."""
        if self.init_fd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)

    def stop(self) -> None:
        self._kill_init()
        super().stop()

    async def _teardown(self) -> None:
        self._kill_init()
        try:
            await super()._teardown()
            if self.init_fd >= 0:  # gone once its namespace is: nothing of the box runs on
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        await _readable(self.init_fd)
        finally:
            if self.init_fd >= 0:
                os.close(self.init_fd)
                self.init_fd = -1


async def _readable(fd: int) -> None:
    """Until pidfd ``fd`` is readable: its process has exited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await done
    finally:
        loop.remove_reader(fd)


class RootlessBwrapBackend(BackendBase):
    name = "bwrap-rootless"
    owner_name = "bwrap"  # its boxes' owner.json (bwrap's sweep removes what they leave)

    _found: ClassVar[RootlessBwrapBackend | None] = None
    _finding: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def for_policy(cls, policy: object) -> RootlessBwrapBackend:
        found = cls._found
        if found is None:
            with cls._finding:  # one per process, as BwrapBackend's
                found = cls._found
                if found is None:
                    found = cls._found = cls()
        return found

    def __init__(self) -> None:
        if os.geteuid() == 0:
            raise BackendUnavailable(
                "the bwrap-rootless backend runs as an ordinary user (its commands act as that "
                "user on the host): as root use backend 'bwrap', or run corral as that user "
                "(e.g. runuser -u USER -- corral ...)"
            )
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise BackendUnavailable(
                "bubblewrap (bwrap) is not installed; as root run once: apt-get install bubblewrap"
            )
        if os.stat(self.bwrap).st_mode & stat.S_ISUID:
            raise BackendUnavailable(
                f"{self.bwrap} is setuid root, which refuses the options corral's rootless mode "
                f"needs (--userns-block-fd); as root run once: chmod u-s {self.bwrap}"
            )
        self.probe = subids.probe()
        if self.probe.userns_problem is not None:
            raise BackendUnavailable(f"rootless bwrap: {self.probe.userns_problem}")
        self.python = find_python()
        self.cgroup_support, self.limit_caps = cgroups.rootless_limits(own_pids=1)
        self.warnings: tuple[str, ...] = ()
        self.devpts_tools = tuple(shutil.which(t, path=SYSTEM_PATH) for t in ("nsenter", "mount"))
        if None in self.devpts_tools:
            self.warnings += (PTY_UNCAPPED,)
        if not self.probe.mapped:
            self.warnings += (SINGLE_ID_WARNING.format(why=self.probe.separation_problem),)

    def sweep_orphans(self) -> list[str]:
        from corral.backends.bwrap.box import sweep_orphans

        return sweep_orphans(
            self.cgroup_support or cgroups.CgroupSupport("none", frozenset(), "", "")
        )

    async def start(self, spec: BoxSpec) -> BwrapBox:
        self._refuse(spec)
        policy = spec.policy
        await blocking(make_private_dir, state_root())
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
        sec_r, sec_w = os.pipe()
        setup_r = setup_w = -1
        if self.cgroup_support is not None:  # bwrap waits, mounts built, for the cgroup move
            setup_r, setup_w = os.pipe()
        fds = bwrap_args.BwrapFds(
            info=info_w, userns_block=block_r, seccomp=sec_r, block=None if setup_r < 0 else setup_r
        )
        proc: HostChild | None = None
        writable: list[list[str]] = []  # the command mounting a writable image root, if any
        init_fd = -1
        try:
            argv = await blocking(
                self._prepare_box, spec, limits, held, fds, sec_w, guest_end.fileno(), writable
            )
            sec_w = -1
            pass_fds = (guest_end.fileno(), info_w, block_r, sec_r, held.args_fd, *held.bind_fds)
            if setup_r >= 0:
                pass_fds += (setup_r,)
            proc = self._spawn(argv, pass_fds)
            held.close_bind_fds()
            for fd in (held.args_fd, info_w, block_r, sec_r, setup_r):
                if fd >= 0:
                    os.close(fd)
            held.args_fd = info_w = block_r = sec_r = setup_r = -1
            fd, info_r = info_r, -1
            info = await _read_info(fd, proc)
            child = int(info["child-pid"])
            init_fd = os.pidfd_open(child)  # bwrap waits for its maps: the pid is its child's
            write_owner(spec.state_dir, "bwrap", bwrap_pid=proc.pid)
            await self._map_ids(child, proc)
            await self._box_mounts(child, proc, writable)
            net = spec.network
            if net is not None and net.needs_attach:
                await net.attach(child)  # full mode: fence the netns first (as in root mode)
            os.write(block_w, b"1")  # bwrap builds the mounts, then execs the agent
            if held.cgroup is not None:
                # bwrap waits on --block-fd, one process, mounts built: every process of
                # the box descends from it (as in root mode).
                await BwrapBackend._add_to_cgroup(held.cgroup, child, proc)
                os.write(setup_w, b"1")
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(init_fd)  # -1 (EBADF) when the start failed before it was opened
            if proc is not None:
                proc.kill()
                await proc.wait()
                proc.close()
            host_end.close()
            await blocking(held.release, spec)
            raise
        finally:
            guest_end.close()
            for fd in (info_r, info_w, block_r, block_w, sec_r, sec_w, setup_r, setup_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            if held.args_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(held.args_fd)
        host_end.setblocking(False)
        box = RootlessBwrapBox(
            spec, proc, host_end, held.cgroup, tuple(held.warnings), limits, pins=(child, held.pins)
        )
        box.init_fd, init_fd = init_fd, -1
        box.rootless = {
            "ids": "subordinate" if self.probe.mapped else "single",
            "limits": "rlimits" if held.cgroup is None else "delegated cgroup v2",
        }
        return box

    @staticmethod
    def _spawn(argv: list[str], pass_fds: tuple[int, ...]) -> HostChild:
        """Start bwrap as this user (``Popen`` on the loop: vfork + exec, ~0.3 ms)."""
        return watch(
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        )

    async def _map_ids(self, child: int, proc: HostChild) -> None:
        """Write the box's uid and gid maps: through newuidmap/newgidmap (subordinate ids),
        or the one id the kernel lets the user map itself."""
        p = self.probe
        if not p.mapped:
            await blocking(self._map_single, child)
            return
        assert p.newuidmap and p.newgidmap
        jobs = [
            (p.newuidmap, rootless_ranges(os.getuid(), p.subids.uid_start)),
            (p.newgidmap, rootless_ranges(os.getgid(), p.subids.gid_start)),
        ]
        runs = [
            await asyncio.create_subprocess_exec(
                *_map_argv(tool, child, ranges),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
            )
            for tool, ranges in jobs
        ]
        for (tool, _), run in zip(jobs, runs, strict=True):
            _, err = await run.communicate()
            if run.returncode != 0:
                said = err.decode(errors="replace").strip() or await proc.stderr()
                raise BackendError(
                    f"{os.path.basename(tool)} could not map the box's ids ({said}); check the "
                    f"ranges of {self.probe.user} in /etc/subuid and /etc/subgid "
                    "(`corral doctor` says what it found)"
                )

    def _refuse(self, spec: BoxSpec) -> None:
        """BackendUnavailable, naming the field and the way out, for what a rootless box
        cannot be: box root's commands (box root is the agent's id here), or a writable
        image root without the tools that mount it in the box's namespace."""
        if spec.policy.user == "root" or spec.user == "root":
            raise BackendUnavailable(
                "policy.user 'root': the bwrap-rootless backend runs commands as the box user "
                "only (box root is the guest agent's id there); box root runs on the bwrap "
                "and oci (runc, crun) backends as root"
            )
        writable = spec.policy.filesystem.root_size is not None
        if spec.policy.image != "host" and writable and None in self.devpts_tools:
            raise BackendUnavailable(
                f"policy.image {spec.policy.image!r}: a writable root is mounted in the box's "
                "own namespace with nsenter and mount (util-linux), which are not installed; "
                "as root run once: apt-get install util-linux mount (or set "
                "filesystem.root_size to null for a read-only root)"
            )

    async def _box_mounts(self, child: int, proc: HostChild, writable: list[list[str]]) -> None:
        """What the host mounts in the box's namespaces (the maps written, bwrap waiting to
        build the box): its capped devpts, and a writable image root's overlay where bwrap
        binds it from as the box's ``/``."""
        if None not in self.devpts_tools:
            await self._mount_devpts(child, proc)
        if writable:
            await self._in_box_namespaces(child, proc, writable[0], "the image's root")

    async def _mount_devpts(self, child: int, proc: HostChild) -> None:
        """The box's capped devpts on :func:`devpts.mount_point`, in the box's mount
        namespace, mounted as box root through the box's user namespace (the user owns it)."""
        _, mount = self.devpts_tools
        assert mount is not None
        command = [
            mount,
            "-t",
            "devpts",
            "-o",
            f"nosuid,noexec,{devpts.OPTIONS}",
            "devpts",
            str(devpts.mount_point()),
        ]
        await self._in_box_namespaces(child, proc, command, "the box's PTY pool (devpts)")

    async def _in_box_namespaces(
        self, child: int, proc: HostChild, command: list[str], what: str
    ) -> None:
        """Run ``command`` as box root in the box's user and mount namespaces (the user owns
        them), while bwrap waits to build the box's mounts; BackendError naming ``what``."""
        nsenter, _ = self.devpts_tools
        assert nsenter is not None
        # nsenter takes box root (setgroups, setuid 0); with one id the user is box root
        # already, and setgroups is denied in its namespace: it keeps its ids then.
        keep = () if self.probe.mapped else ("--preserve-credentials",)
        run = await asyncio.create_subprocess_exec(
            nsenter,
            f"--target={child}",
            "--user",
            "--mount",
            *keep,
            "--",
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
        )
        _, err = await run.communicate()
        if run.returncode != 0:
            said = err.decode(errors="replace").strip() or await proc.stderr()
            raise BackendError(f"{what} could not be mounted: {said}")

    def _image(self, spec: BoxSpec, writable: list[list[str]] | None) -> tuple[Path, Path] | None:
        """``(the image's root in the user's store, what bwrap binds the box's root from)``
        for ``policy.image``, or None for the host's system. A writable root is an overlay
        the box's own namespace mounts (:func:`overlay.userns_root_argv`, its command put in
        ``writable``) at a directory of the box's state dir, where bwrap then finds it; a
        read-only one is the image's entries bound as they are. Blocking (may pull)."""
        policy = spec.policy
        if policy.image == "host":
            return None
        from corral.images import resolve_root

        resolved = resolve_root(policy.image)
        if resolved is None or resolved.rootfs is None:
            return None
        lower = resolved.rootfs
        size = policy.filesystem.root_size
        if size is None or writable is None:
            return lower, lower
        sh = shutil.which("sh", path=SYSTEM_PATH) or "/bin/sh"
        merged, upper = spec.state_dir / "root", spec.state_dir / "root-upper"
        merged.mkdir(mode=0o700)
        upper.mkdir(mode=0o700)
        try:
            writable.append(overlay.userns_root_argv(sh, lower, upper, merged, size))
        except ValueError as exc:
            raise BackendUnavailable(f"policy.image {policy.image!r}: {exc}") from None
        return lower, merged

    @staticmethod
    def _map_single(child: int) -> None:
        Path(f"/proc/{child}/uid_map").write_text(f"0 {os.getuid()} 1\n")
        Path(f"/proc/{child}/setgroups").write_text("deny")
        Path(f"/proc/{child}/gid_map").write_text(f"0 {os.getgid()} 1\n")

    def _prepare_box(
        self,
        spec: BoxSpec,
        limits: LimitPlan,
        held: _Held,
        fds: bwrap_args.BwrapFds,
        sec_w: int,
        channel_fd: int,
        writable: list[list[str]] | None = None,
    ) -> list[str]:
        """Everything before bwrap runs (blocking); what it makes goes into ``held``; the
        command mounting a writable image root goes into ``writable``."""
        policy = spec.policy
        try:
            os.write(sec_w, seccomp.build_filter(policy.security.preset))
        finally:
            os.close(sec_w)
        held.warnings = [*limits.warnings, *self.warnings]
        if self.cgroup_support is not None:
            wanted = cgroups.CgroupLimits(
                memory_bytes=None if "memory_bytes" in limits.unenforced else limits.memory_max,
                cpu_quota=None if "cpu_quota" in limits.unenforced else limits.cpu_quota,
                max_pids=None if "max_pids" in limits.unenforced else limits.pids_max,
            )
            held.cgroup = group = cgroups.Cgroup.create(
                spec.sandbox_id, wanted, self.cgroup_support
            )
            held.warnings += cgroups.late_unenforced(group, limits)
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        masked_file, masked_dir, passwd = shared_files()
        mapped = self.probe.mapped
        # Commands are box uid 1000 (the user on the host) or, with one id, box root.
        box_id = BOX_UID if mapped else 0
        held.shared = shared = idmap.SharedPaths(spec.workspace, uid=os.getuid(), gid=os.getgid())
        config = {**agent_config(spec, uid=box_id, gid=box_id), "fd": channel_fd}
        config["rlimits"] = {
            **agent_rlimits(policy.limits),
            **{k: v for k, v in limits.rlimits.items() if k in ("as", "nproc")},
        }
        config["become_root" if mapped else "undumpable"] = True
        net = spec.network
        image = self._image(spec, writable)
        lower = image[0] if image else None
        config["landlock"] = landlock_rules(
            policy,
            self.python,
            [g for _, g in net.binds()] if net else (),
            image_top=None if lower is None else overlay.image_dirs(lower),
            image_writable=bool(writable),
        )
        if net is not None:
            config["forwarders"] = net.forwarders()
            config["publishers"] = net.publishers_config()
            net.admit(os.getuid(), os.getgid(), namespace_owner=os.getuid())
        inputs = bwrap_args.BwrapInputs(
            workspace=spec.workspace,
            agent_dir=AGENT_DIR,
            python=self.python,
            masked_file=masked_file,
            masked_dir=masked_dir,
            passwd_file=passwd,
            fds=fds,
            agent_args=(json.dumps(config, separators=(",", ":")),),
            extra_binds=tuple(Bind(h, g) for h, g in net.binds()) if net else (),
            sources=shared.sources,
            devpts=None if None in self.devpts_tools else devpts.mount_point(),
            image_root=image[1] if image else None,
            image_writable=bool(writable),
            hidden=hidden_python(self.python) if image else None,
        )
        make = safepath.placeholder_maker(spec.workspace, shared.workspace, shared.sources)
        argv = bwrap_args.bwrap_argv(
            policy, inputs, maskfollow.host_view(policy, spec.workspace, make)
        )
        if lower is not None:  # the overlay starts as the image: look in the image itself
            link = bwrap_args.image_link_in_the_way(argv, lower, bool(writable))
            if link is not None:
                raise ImageError(
                    f"policy.image {policy.image!r}: {link} passes through a symbolic link "
                    "of the image, where corral mounts the box's own; corral does not follow "
                    "an image's links on the host (make it a directory in the image)"
                )
        argv = rootless_argv(argv, mapped)
        if not mapped:
            argv[1:1] = ["--cap-drop", "ALL"]
        argv = BwrapBackend._binds_by_fd(spec, shared, argv, held)
        argv[0] = self.bwrap or "bwrap"
        argv, options = bwrap_args.hide_options(argv)
        held.args_fd = os.memfd_create("corral-bwrap-args", os.MFD_CLOEXEC)
        os.write(held.args_fd, options)
        os.lseek(held.args_fd, 0, os.SEEK_SET)
        argv[2] = str(held.args_fd)
        return argv
