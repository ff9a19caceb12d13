"""The OCI backend: the same box as bwrap's, built by an OCI runtime (runc, crun, runsc).

Start-up sequence::

    1. state dir boxes/<id>: owner.json first (so a crash from here on is swept), then the
       bundle: config.json from :func:`.config.oci_bundle` and an empty root directory
       holding only mount points and the host root's symlinks
    2. ``<runtime> --root <state>/oci/<runtime> run --detach --bundle ... <id>`` with the
       guest end of the channel socketpair as the runtime's stdin: a detached runtime hands
       its stdio to the container process, so the agent finds the channel on fd 0
       (no ``--preserve-fds`` fd shuffling, no pre-exec hook in the runtime's child)
    3. the runtime creates the cgroup ``corral/<id>`` from ``linux.resources``, the
       namespaces and mounts, applies seccomp and the capabilities, and execs the agent

Network modes ``allowlist`` and ``ports`` use the same backend-neutral pieces as bwrap
(:mod:`corral.net`): binds of its network directory and forwarders in the agent's config.
``full`` makes the box join a network namespace corral created and fenced beforehand
(:meth:`corral.net.BoxNetwork.make_netns`): the runtime's init is not dumpable, so pasta could
not attach to it by pid; then the host's ``/sys`` is bound read-only, since only the owner of a
network namespace may mount a sysfs for it.

The agent is PID 1 of the box: when it exits (its channel closed because the host process
died), the kernel kills the rest of the box. ``close()`` and the orphan sweep use the
runtime's ``delete --force``, which also removes the cgroups it made in every hierarchy.

runsc (gVisor) runs the same bundle on its own kernel, with four differences: its file
server, the box's root in the box's user namespace, makes every mount point in the root dir
and cannot open host paths only root may read (their masks are left out: the box cannot
reach them either); the agent installs corral's compiled seccomp filter itself (runsc's own
OCI seccomp turns every errno into EPERM); commands preload a small library
(``gvisor_compat.c``) since this runsc rejects ``AT_NO_AUTOMOUNT`` in stat calls; and the
network is gVisor's loopback only (``--network=none``, with ``--host-uds=open`` for the
proxy and relay sockets), so ``full`` mode is refused.

crun refuses a hybrid cgroup host (v1 controllers plus a cgroup2 mount that holds a
controller), which is this machine's layout. Every crun call therefore runs in a private
mount namespace where the cgroup2 mount is detached: crun sees a pure v1 host, and the
host's mounts are untouched.

When corral is not root, runc and crun run boxes rootless (:mod:`.rootless`): each runtime
call in a user namespace of the user's own, the box without a cgroup (its limits are
rlimits, each said in ``warnings``), its ids those of a rootless bwrap box.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from corral.backends.base import (
    AGENT_DIR,
    BackendBase,
    BoxBase,
    BoxSpec,
    CgroupBox,
    RootLayer,
    agent_config,
    channel_pair,
    sweep_boxes,
)
from corral.backends.host import (
    cgroups,
    devpts,
    idmap,
    maskfollow,
    mountinfo,
    mounts,
    overlay,
    safepath,
    seccomp,
    staging,
    ucounts,
)
from corral.backends.host.boxfiles import shared_files
from corral.backends.host.python import (
    HiddenPython,
    ensure_agent_compiled,
    find_python,
    hidden_python,
)
from corral.backends.host.state import BOX_PREFIX, make_private_dir, state_root, write_owner
from corral.backends.host.subids import NO_CGROUP
from corral.backends.host.threads import blocking
from corral.backends.landlock import rules as landlock_rules
from corral.backends.layout import (
    SYSTEM_PATH,
    Bind,
    unplaceable_mount,
    writable_areas,
)
from corral.backends.limits import LimitPlan, agent_rlimits, plan_limits
from corral.backends.oci import config as oci_config
from corral.backends.oci.rootless import RootlessMode, kill_init, rootless_mode
from corral.backends.users import COMMAND_HOST_ID, HOST_UID_BASE, id_map, id_ranges, own_block
from corral.errors import BackendError, BackendUnavailable, ImageError, PolicyError
from corral.policy import DEFAULT_WORKDIR, Policy

RUNTIMES = ("crun", "runc", "runsc")
"""Tried in this order when the policy names none: crun starts fastest."""
RUNTIME_TIMEOUT = 15.0
GVISOR_OWN_PIDS = 256
"""Host tasks a gVisor box holds besides its own processes (Go threads of its kernel and
file server, about 90 to 140 when idle): added to ``pids.max`` like bwrap's init."""
GVISOR_OWN_MEMORY = 48 << 20
"""What gVisor's kernel and file server charge to the box's cgroup (26-31 MiB measured): added
to its memory cap, so a 16 MiB limit starts a box as on the other backends."""
_PACKAGES = {"runc": "runc", "crun": "crun", "runsc": "runsc (gVisor, from gvisor.dev)"}
_CLONE_NEWNS = 0x00020000
_CLONE_FS = 0x00000200
T = TypeVar("T")


def hybrid_cgroup2_mount(path: str = mountinfo.PATH) -> str | None:
    """The cgroup2 mount point of a hybrid (v1 + v2) host, or None on a pure v1/v2 host."""
    try:
        found = mountinfo.read(path)
    except OSError:
        return None
    v1 = v2 = None
    for mount in found:
        if mount.fstype == "cgroup":
            v1 = mount.mount_point
        elif mount.fstype == "cgroup2":
            v2 = mount.mount_point
    return v2 if v1 and v2 else None


def _own_fs_context() -> None:
    """Give the calling thread its own fs context (cwd, root, umask): a thread that shares
    it with the process may not change mount namespaces."""
    if mounts.libc().unshare(_CLONE_FS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FS)")


def _hide_mount(host_ns: int, path: str) -> None:
    """Move the calling thread into a new private copy of the host's mount namespace
    (``host_ns``, as it is now: the box's idmapped mounts included) without ``path``.
    Linux lets a thread with its own fs context change mount namespaces; the processes it
    spawns inherit the new one, the rest of this process keeps the host's."""
    libc = mounts.libc()
    if libc.setns(host_ns, _CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "setns(host mount namespace)")
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, mounts.MS_REC | mounts.MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.umount2(path.encode(), mounts.MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"umount {path}")


_hidden_threads: ThreadPoolExecutor | None = None
_host_ns = -1
_hidden_lock = threading.Lock()


def _run_without(path: str, call: Callable[[], T]) -> T:
    """``call()`` (which spawns crun) from a thread whose mount namespace is a fresh copy of
    the host's without ``path``. A pre-exec hook instead forks this whole process with the
    GIL held (tens of ms of a busy host's event loop, even from another thread), where a
    plain spawn can vfork."""
    global _hidden_threads, _host_ns
    with _hidden_lock:
        if _hidden_threads is None:
            _host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            _hidden_threads = ThreadPoolExecutor(
                2, thread_name_prefix="corral-crun", initializer=_own_fs_context
            )
        threads, host_ns = _hidden_threads, _host_ns

    def hidden() -> T:
        _hide_mount(host_ns, path)
        return call()

    return threads.submit(hidden).result()


@dataclass(frozen=True, slots=True)
class Runtime:
    """One OCI runtime binary and how corral calls it."""

    name: str
    path: str
    root: Path
    """The runtime's state directory (``--root``): corral's containers only."""
    hidden_mount: str | None = None
    """A mount to hide from the runtime (crun on a hybrid cgroup host)."""
    rootless: RootlessMode | None = None
    """corral is not root: how the runtime runs as the user (:mod:`.rootless`)."""

    @property
    def gvisor(self) -> bool:
        """runsc: gVisor's kernel runs the box (no user namespace, flags of its own)."""
        return self.name == "runsc"

    def argv(self, *args: str, before: list[str] | None = None) -> list[str]:
        """The runtime's command line; ``before`` (rootless): a command run first in the
        runtime's own namespace, which execs the runtime (a writable image root's mounts)."""
        if self.rootless is None:
            return [self.path, "--root", str(self.root), *args]
        # crun would try (and fail) to make a cgroup; runc's rootless mode skips it itself
        flags = ["--cgroup-manager=disabled"] if self.name == "crun" else []
        runtime = [self.path, "--root", str(self.root), *flags, *args]
        return [*self.rootless.outer, *(before or ()), *runtime]

    def run_flags(self, netns: str | None, relays: bool) -> list[str]:
        """Global flags (before the subcommand) of the call that starts a box.

        runsc: ``--network=none`` (gVisor's own loopback only) unless the box joins corral's
        namespace (``full`` mode: ``sandbox`` uses the interfaces found in it); the unix
        sockets of the allowlist proxy and port relays are host sockets, which gVisor lets
        a box connect to only with ``--host-uds=open``."""
        if not self.gvisor:
            return []
        flags = [f"--network={'none' if netns is None else 'sandbox'}"]
        if relays:
            flags.append("--host-uds=open")
        return flags

    def run_sync(
        self,
        *args: str,
        timeout: float = RUNTIME_TIMEOUT,
        stdin: int = subprocess.DEVNULL,
        stderr: int = subprocess.PIPE,
        before: list[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """One runtime command to its end (killed after ``timeout``). Blocking: the event
        loop calls it in a thread (:func:`blocking`)."""
        call = functools.partial(
            subprocess.run,
            self.argv(*args, before=before),
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            timeout=timeout,
            check=False,
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        if self.hidden_mount is None:
            return call()
        return _run_without(self.hidden_mount, call)


def find_runtime(name: str) -> Runtime:
    """The runtime ``name`` if it can run boxes here (BackendUnavailable naming the fix)."""
    if name not in RUNTIMES:
        raise BackendUnavailable(f"unknown OCI runtime {name!r}; use one of {', '.join(RUNTIMES)}")
    path = shutil.which(name)
    if path is None:
        raise BackendUnavailable(
            f"the OCI runtime {name!r} is not installed; install {_PACKAGES[name]} "
            f"or pick another with `--runtime` (see `corral doctor`)"
        )
    hidden = hybrid_cgroup2_mount() if name == "crun" else None
    if os.geteuid() != 0:  # crun's hybrid cgroup mount is covered in its own namespace
        mode = rootless_mode(name, hidden)
        return Runtime(name, path, state_root() / "oci" / name, rootless=mode)
    return Runtime(name, path, state_root() / "oci" / name, hidden)


def _remove_cgroup_dirs(box_id: str) -> None:
    """rmdir ``corral/<id>`` in every hierarchy (the runtime makes it in all of them)."""
    base = Path("/sys/fs/cgroup")
    candidates = [base / "corral" / box_id]
    with contextlib.suppress(OSError):
        candidates += [d / "corral" / box_id for d in base.iterdir()]
    for d in candidates:
        with contextlib.suppress(OSError):
            d.rmdir()


def _delete_container(runtime: Runtime, box_id: str) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        runtime.run_sync("delete", "--force", box_id)


def sweep_orphans(runtimes: list[Runtime]) -> list[str]:
    """Delete containers (and their cgroups and state dirs) whose owner process is dead."""
    boxes = state_root() / "boxes"
    by_name = {r.name: r for r in runtimes}

    def kill(entry: Path, owner: dict[str, Any]) -> None:
        runtime = by_name.get(str(owner.get("runtime")))
        if runtime is not None and runtime.rootless is not None:
            kill_init(entry, entry.name)  # another namespace's runtime could not
        if runtime is not None:
            _delete_container(runtime, entry.name)
        _kill_cgroup(entry.name)
        _remove_cgroup_dirs(entry.name)

    removed = sweep_boxes("oci", kill)
    # A container whose state dir is gone (removed by hand, or a crash between the two
    # removals of close()) belongs to nobody either.
    for runtime in runtimes:
        names = os.listdir(runtime.root) if runtime.root.is_dir() else []
        for name in names:
            if name.startswith(BOX_PREFIX) and not (boxes / name).exists():
                _delete_container(runtime, name)
                _remove_cgroup_dirs(name)
                removed.append(name)
    staging.sweep_staging()  # idmapped workspaces of dead owners, once their boxes are gone
    return removed


def _undo_start(spec: BoxSpec, held: list[idmap.SharedPaths | ucounts.BoxOwner]) -> None:
    """What a failed start leaves once the runtime deleted the box (blocking)."""
    _remove_cgroup_dirs(spec.sandbox_id)
    for shared in held:
        shared.release()
    shutil.rmtree(spec.state_dir, ignore_errors=True)


def _kill_cgroup(box_id: str) -> None:
    group = _open_cgroup(box_id, cgroups.detect())
    if group is not None:
        with contextlib.suppress(BackendError):
            group.kill_all()


def _open_cgroup(box_id: str, support: cgroups.CgroupSupport) -> cgroups.Cgroup | None:
    """corral's view of the group the runtime made (for stats, OOM counts, kill_all)."""
    if support.version == "v2":
        dirs = {"": Path(support.root, cgroups.PARENT, box_id)}
    elif support.version == "v1":
        dirs = {c: Path(m, cgroups.PARENT, box_id) for c, m in support.mounts.items()}
    else:
        return None
    dirs = {c: d for c, d in dirs.items() if d.is_dir()}
    if not dirs:
        return None
    return cgroups.Cgroup(box_id, support.version, dirs, cgroups.CgroupLimits(), support)


Pinned = safepath.Pinned
"""A bind's guest path and the (st_dev, st_ino) the box must see there."""


def _pin_binds(
    spec: BoxSpec, shared: idmap.SharedPaths, mounts: list[dict[str, Any]]
) -> list[Pinned]:
    """Bind sources that lie in a writable area (the workspace, ``allow_write``, rw mounts,
    their idmapped mount points) are opened beneath that area without following a symlink
    (a PolicyError if that fails: a link planted by a box) and their identity kept; so is
    the identity of every bind *at* a path inside such an area's guest directory (a mask, a
    nested share). The runtime mounts by path, so :func:`_check_pins` then compares what the
    box got: a box running on the same workspace that swapped a path (or a link into a
    mask's path) in between makes the start fail."""
    areas = [
        *writable_areas(spec.policy, spec.workspace),
        str(shared.workspace),
        *shared.sources.values(),
    ]
    in_area = safepath.area_finder(areas)
    binds = [
        (i, m["source"], str(m["destination"]))
        for i, m in enumerate(mounts)
        if m.get("type") == "bind" and isinstance(m.get("source"), str) and m.get("destination")
    ]
    writable = [dest for _, source, dest in binds if in_area(source) is not None]
    last = {m.get("destination"): i for i, m in enumerate(mounts)}
    pins: list[Pinned] = []
    for i, source, dest in binds:
        inside = any(d != dest and dest.startswith(d.rstrip("/") + "/") for d in writable)
        if in_area(source) is None and not inside:
            continue
        try:
            pinned = safepath.pin(dest, source, areas)
        except OSError as exc:
            raise PolicyError(
                f"{source} lies in a writable area and cannot be opened without following "
                f"a link ({exc.strerror}; made by a box?): remove the link"
            ) from None
        if last[dest] == i:  # a later mount on the same path (a mask) is what the box sees
            pins.append(pinned)
    return pins


def _stage_sources(spec: BoxSpec, shared: idmap.SharedPaths, mounts_: list[dict[str, Any]]) -> None:
    """gVisor's gofer opens every bind source by its path, as it starts, and the box's
    mounts live in its own namespace where the host cannot compare them with what it meant
    (as :func:`_check_pins` does for runc and crun). So on runsc each source inside a
    writable area (a ``deny_write`` path, a share not idmapped) is opened by the host
    beneath its area without following a link and bound from that descriptor onto a staging
    mount point (root's, outside every writable area); the gofer gets that path. A box on
    the same workspace swapping the original path later changes nothing the box mounts."""
    areas = [
        *writable_areas(spec.policy, spec.workspace),
        str(shared.workspace),
        *shared.sources.values(),
    ]
    in_area = safepath.area_finder(areas)
    # The shares themselves are mount points the host made from fds (or the workspace the
    # caller named): paths *below* them are the box's to change.
    roots = {str(shared.workspace), *shared.sources.values()}
    staged: dict[str, str] = {}
    for mount in mounts_:
        source = mount.get("source")
        if mount.get("type") != "bind" or not isinstance(source, str):
            continue
        if source in roots or in_area(source) is None:
            continue
        if source not in staged:
            staged[source] = _stage(spec, shared, source, areas)
        mount["source"] = staged[source]


def _stage(spec: BoxSpec, shared: idmap.SharedPaths, source: str, areas: list[str]) -> str:
    try:
        fd = safepath.open_path(source, os.O_PATH, areas)
    except OSError as exc:
        raise PolicyError(
            f"{source} lies in a writable area and cannot be opened without following "
            f"a link ({exc.strerror}; made by a box?): remove the link"
        ) from None
    try:
        if shared.binds is None:
            shared.binds = idmap.IdmappedBinds(spec.sandbox_id)
        entry = staging.new_entry("mnt", f"{spec.sandbox_id}.src{len(shared.binds.entries)}")
        shared.binds.entries.append(entry)  # released with the box's shares
        target = entry / "ws"
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # a file is mounted on a file
            target.rmdir()
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        mounts.bind(safepath.fd_source(fd), str(target))
    finally:
        os.close(fd)
    return str(target)


def _check_pins(init_pid: int, pins: list[Pinned]) -> None:
    """Refuse a box whose bind mounts are not the objects :func:`_pin_binds` opened."""
    safepath.check_pins(init_pid, pins)


def _write_bundle(bundle: Path, result: oci_config.OciBundle) -> None:
    rootfs = bundle / "rootfs"
    rootfs.mkdir(mode=0o755)
    for d, mode in result.dirs:
        path = rootfs / d.lstrip("/")
        path.mkdir(exist_ok=True)
        path.chmod(mode)
    for f in result.files:
        (rootfs / f.lstrip("/")).touch(mode=0o644)
    for link in result.symlinks:
        os.symlink(link.target, rootfs / link.dest.lstrip("/"))
    (bundle / "config.json").write_text(json.dumps(result.config, separators=(",", ":")))


@dataclass(slots=True)
class _Image:
    """A box's root on ``policy.image``: the mounted root (:mod:`corral.backends.host.overlay`,
    its staging entries released with the box's shared paths), how the agent's interpreter
    runs beside it, and the writable root's upper (None: read-only)."""

    root: overlay.ImageRoot
    hidden: HiddenPython
    layer: RootLayer | None = None
    lower: Path | None = None
    """The image's own root, where corral looks for its links (the root itself, unless the
    overlay lives in a namespace the host does not see: rootless)."""
    writable: bool = False
    """The root is a writable overlay (``root_size``)."""
    mount_argv: list[str] | None = None
    """Rootless: the command that mounts the writable root in the runtime's own namespace
    before it runs (:func:`corral.backends.host.overlay.userns_root_argv`)."""


def _other_ids(spec: BoxSpec, owner: ucounts.BoxOwner | None) -> int:
    """Where the box's ids but 0 and 1000 start on the host: a block of its own when its
    commands are box root (they may take any of its ids), else the shared range."""
    return own_block(owner.uid) if owner is not None and spec.user == "root" else HOST_UID_BASE


def _image_checked(spec: BoxSpec, image: _Image, bundle: oci_config.OciBundle) -> RootLayer | None:
    """Refuse an image whose own symlink lies where the box's mounts go (``/tmp -> /etc``):
    corral follows no link of an image on the host, and the bundle's mount points would be
    made through it. Returns the writable root's layer with the mount points the runtime
    makes in the overlay (not changes of the box)."""
    dests = oci_config.root_destinations(bundle.config["mounts"])
    root = image.lower or image.root.root
    if not image.writable:  # the bundle's root holds the image's top-level links
        links = {link.dest for link in bundle.symlinks}
        link = next((d for d in dests if any(d == t or d.startswith(t + "/") for t in links)), None)
    else:  # the overlay starts as the image: look in the image (or the overlay) itself
        link = overlay.link_in_the_way(root, dests)
    if link is not None:
        raise ImageError(
            f"policy.image {spec.policy.image!r}: {link} passes through a symbolic link of the "
            "image, where corral mounts the box's own; corral does not follow an image's "
            "links on the host (make it a directory in the image)"
        )
    if image.layer is None:
        return None
    return dataclasses.replace(image.layer, mount_points=overlay.missing_in_image(root, dests))


class OciBox(CgroupBox):
    backend = "oci"
    rootless: dict[str, str] | None = None
    """``info()["rootless"]`` of a rootless box: how its ids are mapped, what limits it."""

    def __init__(
        self,
        spec: BoxSpec,
        runtime: Runtime,
        channel: socket.socket,
        cgroup: cgroups.Cgroup | None,
        warnings: tuple[str, ...],
        limits: LimitPlan,
        shared: idmap.SharedPaths | None = None,
        owner: ucounts.BoxOwner | None = None,
        root_layer: RootLayer | None = None,
    ) -> None:
        super().__init__(spec, channel, warnings, limits)
        self.root_layer = root_layer
        self._runtime = runtime
        self._cgroup = cgroup
        self._own_pids = limits.own_pids
        self._shared = shared
        if shared is not None:
            self.user_ids = (shared.uid, shared.gid)
        self._owner = owner

    @property
    def init_pid(self) -> int | None:
        """Host pid of the box's PID 1 (the agent), or None once it is gone."""
        try:
            return _read_pid(self._spec.state_dir / "init.pid")
        except BackendError:
            return None

    def _facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"runtime": self._runtime.name, "runtime_path": self._runtime.path}
        if self.rootless is not None:
            facts["rootless"] = dict(self.rootless)
        return facts

    async def diagnose(self) -> str:
        """What the runtime or the agent wrote to stderr before the box failed."""
        try:
            return (self._spec.state_dir / "stderr.log").read_text(errors="replace")[-8192:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self._cgroup is not None:
            with contextlib.suppress(Exception):
                self._cgroup.kill_all(wait=False)
        elif self._runtime.rootless is not None:
            with contextlib.suppress(Exception):
                kill_init(self._spec.state_dir, self._spec.sandbox_id)

    async def _teardown(self) -> None:
        if self._runtime.rootless is not None:  # the runtime's namespace of now cannot
            await blocking(kill_init, self._spec.state_dir, self._spec.sandbox_id)
        await _delete(self._runtime, self._spec.sandbox_id)  # kills the box
        await self._release_host(self._cgroup, self._shared, self._owner)


async def _delete(runtime: Runtime, box_id: str) -> str:
    """``delete --force``: kills the box, removes the runtime's state and cgroups."""
    try:
        done = await blocking(runtime.run_sync, "delete", "--force", box_id)
    except subprocess.TimeoutExpired:
        return f"{runtime.name} delete timed out"
    except OSError as exc:
        return f"{runtime.name} delete failed: {exc}"
    return done.stderr.strip() if done.returncode else ""


async def _runtime_step(
    runtime: Runtime,
    spec: BoxSpec,
    channel_fd: int,
    bundle: Path,
    flags: list[str],
    before: list[str] | None = None,
) -> None:
    """``run --detach`` one box off the loop (the seam where an attack test swaps the
    workspace just before the runtime runs)."""
    await blocking(_run_detached, runtime, spec, channel_fd, bundle, flags, before)


def _run_detached(
    runtime: Runtime,
    spec: BoxSpec,
    channel_fd: int,
    bundle: Path,
    flags: list[str],
    before: list[str] | None = None,
) -> None:
    """``run --detach`` one box, raising the runtime's error. Blocking."""
    step = "run"
    pid_file = str(spec.state_dir / "init.pid")
    args = [*flags, step, "--detach", "--bundle", str(bundle), "--pid-file", pid_file]
    # A runtime started without a terminal hands its stdio to the box's process: the
    # channel is the agent's fd 0, and stderr.log gets the runtime's errors, then the
    # agent's own stderr (diagnose()).
    # Read back through the same descriptor: rootless crun hands the file to box root (a
    # subordinate id), after which the user could no longer open it by path.
    stderr = os.open(spec.state_dir / "stderr.log", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        code = runtime.run_sync(
            *args, spec.sandbox_id, stdin=channel_fd, stderr=stderr, before=before
        ).returncode
        if code != 0:
            os.lseek(stderr, 0, os.SEEK_SET)
            detail = _read_all(stderr).decode(errors="replace").strip()
            raise BackendError(f"`{runtime.name} {step}` failed to start the box: {detail[-4000:]}")
    except subprocess.TimeoutExpired:
        raise BackendError(
            f"`{runtime.name} {step}` did not finish within {RUNTIME_TIMEOUT:g} s"
        ) from None
    finally:
        os.close(stderr)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError) as exc:
        raise BackendError(f"the OCI runtime wrote no usable pid file {path}: {exc}") from None


class OciBackend(BackendBase):
    name = "oci"

    @classmethod
    def for_policy(cls, policy: Policy) -> OciBackend:
        if policy.runtime is not None:
            return cls(find_runtime(policy.runtime))
        reasons = []
        for name in RUNTIMES:
            try:
                return cls(find_runtime(name))
            except BackendUnavailable as exc:
                reasons.append(exc.message)
        raise BackendUnavailable("no OCI runtime works here: " + "; ".join(reasons))

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.python = find_python()
        self.delegated: cgroups.CgroupSupport | None = None
        if runtime.rootless is not None:  # a group in the user's delegated subtree, if any
            self.delegated, self.limit_caps = cgroups.rootless_limits()
            self.cgroup_support = self.delegated or cgroups.CgroupSupport(
                "none", frozenset(), "", NO_CGROUP
            )
            return
        ucounts.lift_msgqueue_limit()  # the runtime owns every box's user namespace
        self.cgroup_support = cgroups.detect()
        self.limit_caps = cgroups.limit_capabilities(self.cgroup_support)

    def sweep_key(self) -> str:
        return f"oci/{self.runtime.name}"

    def sweep_orphans(self) -> list[str]:
        removed = sweep_orphans([self.runtime])
        ucounts.sweep_free_slots()  # what a dead owner's box left running as its uids
        return removed

    async def start(self, spec: BoxSpec) -> OciBox:
        self._refuse_image(spec)
        runtime = self.runtime
        await self.prepare()
        await ensure_agent_compiled(AGENT_DIR, self.python)
        limits = self._refuse_or_plan(spec)
        host_end, guest_end = channel_pair()
        cgroup: cgroups.Cgroup | None = None
        late: list[str] = []  # limits a delegated group could not take after all
        held: list[idmap.SharedPaths | ucounts.BoxOwner] = []
        userns = -1
        pins: list[Pinned] = []  # bind sources in writable areas, checked once mounted
        image: list[_Image] = []  # the box's root on policy.image, once mounted
        try:
            # Directories, owner.json and the idmapped mounts, then the bundle, in threads:
            # mount calls wait for RCU grace periods, and a bundle is dozens of mkdirs.
            shared = await blocking(self._share, spec, held, image)
            owner = next((h for h in held if isinstance(h, ucounts.BoxOwner)), None)
            root = owner.uid if owner is not None else HOST_UID_BASE  # box root's host uid
            others = _other_ids(spec, owner)
            maps = (id_map(shared.uid, root, others), id_map(shared.gid, root, others))
            if spec.network is not None:  # who connects to its sockets; pasta's uid
                user = (os.getuid(), os.getgid()) if runtime.rootless else (root, shared.gid)
                spec.network.admit(*user, namespace_owner=user[0])
            # full mode: the box joins a namespace corral made and fenced (by path: the
            # runtime's init is not dumpable, so pasta could not attach to it by pid), and
            # the user namespace that holds it, with the box's maps.
            netns = None
            if spec.network is not None:
                netns = await spec.network.make_netns(maps if owner else None)
            userns_path = spec.network.userns_path if spec.network is not None else None
            if owner is not None and userns_path is None:
                userns = await blocking(ucounts.make_userns, owner.uid, *maps)
                # The runtime runs as root: it opens this process's fd by its /proc path.
                userns_path = f"/proc/{os.getpid()}/fd/{userns}"
            compat, compat_warning = None, None
            if runtime.gvisor:
                compat, compat_warning = await blocking(gvisor_compat_library)
            bundle = spec.state_dir / "bundle"
            where = (userns_path, root)
            await blocking(
                self._write_bundle, spec, shared, limits, netns, compat, bundle, where, pins, image
            )
            layer = image[0].layer if image else None
            relays = spec.network is not None and bool(
                spec.network.forwarders() or spec.network.publishers
            )
            flags = runtime.run_flags(netns, relays)
            before = image[0].mount_argv if image else None
            await _runtime_step(runtime, spec, guest_end.fileno(), bundle, flags, before)
            if pins:  # before the agent hears of anything to run (openat2 walks: off the loop)
                init_pid = _read_pid(spec.state_dir / "init.pid")
                await blocking(_check_pins, init_pid, pins)
            cgroup = await self._group_of(spec, limits, late)
        except BaseException:
            host_end.close()
            await self._undo(spec, cgroup, held)
            raise
        finally:
            guest_end.close()
            if userns >= 0:  # the box's processes hold its namespace now
                os.close(userns)
        host_end.setblocking(False)
        said = (shared.warning, compat_warning, runtime.rootless and runtime.rootless.warning)
        warnings = limits.warnings + tuple(late) + tuple(w for w in said if w)
        box = OciBox(spec, runtime, host_end, cgroup, warnings, limits, shared, owner, layer)
        if runtime.rootless is not None:
            box.rootless = {**runtime.rootless.facts}
            if cgroup is not None:
                box.rootless["limits"] = "delegated cgroup v2"
        return box

    def _refuse_image(self, spec: BoxSpec) -> None:
        """BackendUnavailable, naming the field and the way out, for a box on an image (or
        whose commands are box root) where this runtime cannot run one."""
        runtime = self.runtime
        if spec.policy.image == "host" and spec.policy.user != "root" and spec.user != "root":
            return
        what = (
            f"policy.image {spec.policy.image!r}"
            if spec.policy.image != "host"
            else "policy.user 'root'"
        )
        if runtime.gvisor:
            raise BackendUnavailable(
                f"{what}: runsc (gVisor) does not run boxes on an image or as box root here "
                "(its file server cannot reach the box's overlay root); use runtime 'runc' or "
                "'crun', or the bwrap backend"
            )
        if runtime.rootless is not None and (spec.policy.user == "root" or spec.user == "root"):
            raise BackendUnavailable(
                "policy.user 'root': the oci backend rootless runs commands as the box user "
                "only (box root is the guest agent's id there); box root runs on the bwrap and "
                "oci (runc, crun) backends as root"
            )

    def _rootless_image(self, spec: BoxSpec) -> _Image | None:
        """The root of ``policy.image`` for a rootless runtime: the user's own store; a
        writable root is an overlay mounted in the runtime's own user and mount namespace
        just before it runs (the box's namespace is made from that one, and keeps the mount
        when the runtime is gone: nothing to release on the host), at a directory of the
        box's state dir; a read-only one the image's entries bound as they are. Blocking."""
        policy = spec.policy
        from corral.images import resolve_root

        resolved = resolve_root(policy.image)
        if resolved is None or resolved.rootfs is None:
            return None
        lower = resolved.rootfs
        hidden = hidden_python(self.python)
        size = policy.filesystem.root_size
        if size is None:
            return _Image(overlay.ImageRoot(lower, None), hidden, lower=lower)
        merged, upper = spec.state_dir / "root", spec.state_dir / "root-upper"
        merged.mkdir(mode=0o700)
        upper.mkdir(mode=0o700)
        sh = shutil.which("sh", path=SYSTEM_PATH) or "/bin/sh"
        try:
            argv = overlay.userns_root_argv(sh, lower, upper, merged, size, then_exec=True)
        except ValueError as exc:
            raise BackendUnavailable(f"policy.image {policy.image!r}: {exc}") from None
        root = overlay.ImageRoot(merged, None)
        return _Image(root, hidden, lower=lower, writable=True, mount_argv=argv)

    def _mount_image(
        self, spec: BoxSpec, shared: idmap.SharedPaths, owner: ucounts.BoxOwner
    ) -> _Image | None:
        """The box's root on ``policy.image``, mounted as on bwrap (:mod:`.overlay`): the
        image idmapped with the box's own id maps under a per-box overlay of
        ``filesystem.root_size``, its staging entries released with the shared paths.
        Blocking (a registry ref not stored yet is pulled)."""
        policy = spec.policy
        from corral.images import resolve_root

        resolved = resolve_root(policy.image, cow=policy.filesystem.root_size is not None)
        if resolved is None or resolved.rootfs is None:
            return None
        hidden = hidden_python(self.python)
        if shared.binds is None:
            shared.binds = idmap.IdmappedBinds(spec.sandbox_id)
        others = _other_ids(spec, owner)
        uids = id_ranges(shared.uid, owner.uid, others)
        root = overlay.mount_image_root(
            spec.sandbox_id,
            resolved.rootfs,
            shared.binds.entries,
            uids=uids,
            gids=id_ranges(shared.gid, owner.uid, others),
            owner=owner.uid,
            size=policy.filesystem.root_size,
            # The image's WorkingDir is the default cwd: made as Docker makes a WORKDIR.
            workdir=resolved.config.workdir if policy.workdir == DEFAULT_WORKDIR else None,
            seed=resolved.cow,
            release=shared.binds.after,
        )
        layer = None
        if root.upper is not None:
            layer = RootLayer(root.upper, tuple(uids), subvolume=root.subvolume)
        return _Image(root, hidden, layer, writable=layer is not None)

    def _refuse_or_plan(self, spec: BoxSpec) -> LimitPlan:
        """What this runtime cannot run (PolicyError or BackendUnavailable, with the way
        out), else the box's limits."""
        runtime = self.runtime
        problem = unplaceable_mount(spec.policy)
        if problem is not None:
            raise PolicyError(problem)
        if runtime.rootless is not None and spec.policy.network.mode == "full":
            raise BackendUnavailable(
                "network mode 'full' is not available on the oci backend rootless: pasta "
                "cannot join the network namespace of a box whose runtime made its user "
                "namespace; use backend 'bwrap' (rootless too), or 'allowlist' or 'ports'"
            )
        if runtime.gvisor and spec.policy.network.mode == "full":
            raise BackendUnavailable(
                "network mode 'full' is not available with runsc here: this gVisor release "
                "does not take the interfaces of the network namespace corral prepares; use "
                "network.mode 'allowlist' or 'ports', or runc/crun for 'full'"
            )
        caps = self.limit_caps
        if runtime.gvisor:  # the sentry's and gofer's own threads live in the box's cgroup
            caps = dataclasses.replace(
                caps, own_pids=GVISOR_OWN_PIDS, own_memory_bytes=GVISOR_OWN_MEMORY
            )
        return plan_limits(spec.policy.limits, caps)

    async def _group_of(
        self, spec: BoxSpec, limits: LimitPlan, late: list[str]
    ) -> cgroups.Cgroup | None:
        """The started box's cgroup: the one the runtime made (root mode), or one made in the
        user's delegated subtree (rootless, where there is one)."""
        if self.runtime.rootless is None:
            return _open_cgroup(spec.sandbox_id, self.cgroup_support)
        if self.delegated is None:
            return None
        return await blocking(self._rootless_group, spec, limits, late)

    async def _undo(
        self,
        spec: BoxSpec,
        cgroup: cgroups.Cgroup | None,
        held: list[idmap.SharedPaths | ucounts.BoxOwner],
    ) -> None:
        """End a box that failed to start, and remove what it left."""
        if self.runtime.rootless is not None:  # the runtime's namespace of now cannot
            await blocking(kill_init, spec.state_dir, spec.sandbox_id)
        await _delete(self.runtime, spec.sandbox_id)
        if cgroup is not None and self.runtime.rootless is not None:
            await BoxBase._release_host(cgroup, kill=True)
        await blocking(_undo_start, spec, held)

    def _rootless_group(self, spec: BoxSpec, limits: LimitPlan, late: list[str]) -> cgroups.Cgroup:
        """A rootless box's group in the user's delegated subtree, with the box's init (the
        agent, pid 1 of the box, which has forked nothing yet) moved into it: everything the
        box runs descends from it. Blocking."""
        assert self.delegated is not None
        wanted = cgroups.CgroupLimits(
            memory_bytes=None if "memory_bytes" in limits.unenforced else limits.memory_max,
            cpu_quota=None if "cpu_quota" in limits.unenforced else limits.cpu_quota,
            max_pids=None if "max_pids" in limits.unenforced else limits.pids_max,
        )
        group = cgroups.Cgroup.create(spec.sandbox_id, wanted, self.delegated)
        try:
            group.add(_read_pid(spec.state_dir / "init.pid"))
        except BaseException:
            with contextlib.suppress(Exception):
                group.remove()
            raise
        late += cgroups.late_unenforced(group, limits)
        return group

    def _share(
        self,
        spec: BoxSpec,
        held: list[idmap.SharedPaths | ucounts.BoxOwner],
        image: list[_Image] | None = None,
    ) -> idmap.SharedPaths:
        """The state directory with owner.json (so a crash from here on is swept), then (not
        on gVisor) the host uid of the box's own that will own its user namespace: the
        kernel charges inotify and message queue quotas to that owner, which would otherwise
        be host root (the runtime's uid) for every box; from its slot, the box user's host id
        (epoll watches, pipe buffers and processes are counted per host uid). Then the
        idmapped mounts (into ``held`` as soon as they exist). Blocking."""
        runtime = self.runtime
        if runtime.rootless is not None:  # /tmp is shared: the state root must be the user's
            make_private_dir(state_root())
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        write_owner(spec.state_dir, "oci", runtime=runtime.name, runtime_root=str(runtime.root))
        if runtime.rootless is not None:  # commands are the user: the workspace as it is
            shared = idmap.SharedPaths(spec.workspace, uid=os.getuid(), gid=os.getgid())
            held.append(shared)
            if image is not None and spec.policy.image != "host":
                mounted = self._rootless_image(spec)
                if mounted is not None:
                    image.append(mounted)
            return shared
        user = COMMAND_HOST_ID
        owner = None
        if not runtime.gvisor:  # gVisor's inotify, queues, PTYs and epoll are its kernel's
            owner = ucounts.claim_owner()
            held.append(owner)
            devpts.refuse_beyond_pool(owner.slot)  # its max= must fit beside the others'
            user = owner.command_id
        if owner is not None and spec.user == "root":
            # Box root's commands own the shared paths: their owner's files appear as box
            # root's (the namespace owner's host uid); box uid 1000 keeps its own host id.
            shared = idmap.share_paths(spec, user=owner.uid)
            held.append(shared)
            if shared.binds is not None or spec.workspace_prepared:
                shared.uid = shared.gid = owner.command_id
        else:
            # gVisor's file server is the box's root: shared paths take its files too.
            shared = idmap.share_paths(spec, box_root=runtime.gvisor, user=user)
            held.append(shared)
        if image is not None and owner is not None and spec.policy.image != "host":
            mounted = self._mount_image(spec, shared, owner)
            if mounted is not None:
                image.append(mounted)
        return shared

    def _write_bundle(
        self,
        spec: BoxSpec,
        shared: idmap.SharedPaths,
        limits: LimitPlan,
        netns: str | None,
        compat: Path | None,
        bundle: Path,
        userns: tuple[str | None, int] = (None, HOST_UID_BASE),
        pins: list[Pinned] | None = None,
        image: list[_Image] | None = None,
    ) -> oci_config.OciBundle:
        """Translate the policy and write the bundle (config.json, root dir). Blocking."""
        on = image[0] if image else None
        result = self._bundle(spec, shared, limits, netns, compat, userns, pins, on)
        if on is not None:  # before anything is made by path in the root
            on.layer = _image_checked(spec, on, result)
        bundle.mkdir()
        _write_bundle(bundle, result)
        self.runtime.root.mkdir(parents=True, exist_ok=True)
        return result

    def _bundle(
        self,
        spec: BoxSpec,
        shared: idmap.SharedPaths,
        limits: LimitPlan,
        netns: str | None = None,
        compat: Path | None = None,
        userns: tuple[str | None, int] = (None, HOST_UID_BASE),
        pins: list[Pinned] | None = None,
        image: _Image | None = None,
    ) -> oci_config.OciBundle:
        masked_file, masked_dir, passwd = shared_files()
        rootless = self.runtime.rootless
        root_commands = spec.user == "root" and rootless is None
        ids = {"uid": 0, "gid": 0} if root_commands else {}
        config: dict[str, Any] = {**agent_config(spec, **ids), "fd": 0}
        if root_commands:
            # Commands share the agent's uid: only this keeps them out of its /proc/PID/fd
            # (the channel to the host), environ and memory (they hold no CAP_SYS_PTRACE).
            config["undumpable"] = True
        image_root = None if image is None else image.root.root
        if rootless is not None:
            if not rootless.mapped:  # commands are box root, the agent's id: keep it out
                config.update(uid=0, gid=0, undumpable=True)
            # No cgroup: memory and processes are bounded per command (limits.warnings)
            config["rlimits"] = {
                **agent_rlimits(spec.policy.limits),
                **{k: v for k, v in limits.rlimits.items() if k in ("as", "nproc")},
            }
        seccomp_file = None
        if self.runtime.gvisor:
            seccomp_file = spec.state_dir / "seccomp.bpf"
            seccomp_file.write_bytes(seccomp.build_filter(spec.policy.security.preset))
            config["seccomp"] = oci_config.GUEST_SECCOMP
            if compat is not None:
                config["env"] = {"LD_PRELOAD": oci_config.GUEST_COMPAT}
        net = spec.network
        config["landlock"] = landlock_rules(
            spec.policy,
            self.python,
            [g for _, g in net.binds()] if net else (),
            deferred=spec.workspace_prepared,
            image_top=None if image_root is None else overlay.image_dirs(image_root),
            image_writable=image is not None and image.writable,
        )
        if net is not None:
            config["forwarders"] = net.forwarders()
            config["publishers"] = net.publishers_config()
        inputs = oci_config.OciInputs(
            sandbox_id=spec.sandbox_id,
            workspace=shared.workspace,
            owner_uid=shared.uid,
            owner_gid=shared.gid,
            agent_dir=AGENT_DIR,
            python=self.python,
            masked_file=masked_file,
            masked_dir=masked_dir,
            passwd_file=passwd,
            agent_args=(json.dumps(config, separators=(",", ":")),),
            limits=limits,
            extra_binds=tuple(Bind(h, g) for h, g in net.binds()) if net else (),
            host_mounts=mountinfo.mount_points(),
            sources=shared.sources,
            netns_path=netns,
            userns_path=userns[0],
            root_uid=userns[1],
            seccomp_file=str(seccomp_file) if seccomp_file else None,
            compat_library=str(compat) if compat else None,
            rootless=rootless.box_ranges if rootless is not None else None,
            image_root=image_root,
            image_writable=image is not None and image.writable,
            hidden=None if image is None else image.hidden,
            root_commands=root_commands,
            others=own_block(userns[1]) if root_commands else HOST_UID_BASE,
            gvisor=self.runtime.gvisor,
        )
        make = safepath.placeholder_maker(spec.workspace, shared.workspace, shared.sources)
        bundle = oci_config.oci_bundle(
            spec.policy, inputs, maskfollow.host_view(spec.policy, spec.workspace, make)
        )
        if self.runtime.gvisor:  # the gofer opens sources by path, and we cannot look in
            _stage_sources(spec, shared, bundle.config["mounts"])
        elif pins is not None:
            pins += _pin_binds(spec, shared, bundle.config["mounts"])
        return bundle


_COMPAT_SOURCE = Path(__file__).with_name("gvisor_compat.c")


def gvisor_compat_library() -> tuple[Path | None, str | None]:
    """The compatibility library preloaded into a gVisor box's commands (see
    ``gvisor_compat.c``), compiled once per source version under the state root; or None and
    why (a warning of the box) when there is no C compiler."""
    source = _COMPAT_SOURCE.read_bytes()
    target = state_root() / "shared" / f"gvisor-compat-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.exists():
        return target, None
    compiler = shutil.which("cc") or shutil.which("gcc")
    why = "`ls -l` and `stat` fail with EINVAL under runsc releases before 2023"
    if compiler is None:
        return None, f"{why}: no C compiler (cc) to build corral's compatibility library"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(_COMPAT_SOURCE)],
            capture_output=True,
            timeout=60,
            check=True,
            env={"PATH": SYSTEM_PATH},
        )
        partial.chmod(0o644)
        partial.rename(target)  # atomic: concurrent first starts both compile, one wins
    except (OSError, subprocess.SubprocessError) as exc:
        partial.unlink(missing_ok=True)
        return None, f"{why}: building corral's compatibility library failed ({exc})"
    return target, None


def _swap_limit_file(support: cgroups.CgroupSupport) -> bool:
    """Whether the runtime can cap swap (OCI ``memory.swap``): the file must exist."""
    if support.version == "v1":
        mount = support.mounts.get("memory")
        return mount is not None and Path(mount, "memory.memsw.limit_in_bytes").exists()
    if support.version == "v2":
        return next(Path(support.root).glob("*/memory.swap.max"), None) is not None
    return False
