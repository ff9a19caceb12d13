"""``Policy -> OCI config.json``: a pure function, so every policy field is unit-tested.

The box looks exactly like a bwrap box (same layout from :mod:`corral.backends.layout`, same guest
agent, same users), expressed in the OCI runtime spec so that runc, crun or runsc builds it::

    root.path          an empty per-box directory, read-only; only mount points live in it
    mounts             /proc /dev /dev/pts /dev/shm /sys (read-only), the host system's
                       entries read-only (their submounts too), /tmp /run /home tmpfs,
                       the agent, the workspace, then deny_write and deny_read covers
    linux.namespaces   user, pid, ipc, uts, mount, cgroup, network (empty, or a path
                       prepared by the host once network modes come to this backend)
    uid/gidMappings    box 0..999 -> an unprivileged host range, box 1000 -> the
                       workspace owner (so workspace files keep their owner on the host)
    process            the agent as box root with CAP_SETUID/CAP_SETGID only and
                       no_new_privs; it runs every command as uid 1000 with no capability
    linux.seccomp      the same rules as the bwrap filter (:func:`seccomp.oci_seccomp`)
    linux.resources    memory/pids/cpu limits the host's cgroups can enforce, in the
                       group ``cgroupsPath`` = ``/corral/<box id>`` (the bwrap path too)

For runsc (``OciInputs.gvisor``) the seccomp filter is left to the agent, every mount
point is made in the root dir, and masks over host paths an unmapped uid cannot open are
left out (see :func:`_reachable_masks`).

Symlinks of the host root (``/bin -> usr/bin``) and mount points outside the host binds
cannot be expressed as mounts: :func:`oci_bundle` lists them for the driver to create in
the root directory before the runtime starts.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.backends.host import safepath, seccomp
from corral.backends.host.cgroups import PARENT
from corral.backends.host.overlay import image_has_file
from corral.backends.host.python import HOST_PREFIX, HiddenPython
from corral.backends.layout import (
    CGROUP_DIR,
    GUEST_AGENT_DIR,
    PROC_READ_ONLY,
    PTY_MAX,
    SYSTEM_PATH,
    Bind,
    HostView,
    Symlink,
    image_entries,
    on_shared_paths,
    passwd_binds,
    policy_binds,
    root_entries,
)
from corral.backends.limits import Capabilities, LimitPlan, plan_limits
from corral.backends.users import BOX_UID, GUEST_HOME, HOST_UID_BASE, ROOT_CAPS, id_ranges
from corral.policy import Policy

OCI_VERSION = "1.0.2"
AGENT_CAPS = ("CAP_SETUID", "CAP_SETGID")
# Kernel interfaces a box has no use for (the list runc, crun and podman mask by default).
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
GUEST_SECCOMP = "/run/corral/seccomp.bpf"
"""Where a gVisor box's agent finds the compiled filter it installs on itself."""
GUEST_COMPAT = "/run/corral/gvisor-compat.so"
"""Where a gVisor box's commands find the library they preload (``gvisor_compat.c``)."""
NAMESPACES = ("user", "pid", "ipc", "uts", "mount", "cgroup")
"""Namespaces of a box besides the network's."""
# Mounted by the runtime itself, so never bound from the host.
_OWN_MOUNTS = ("/proc", "/dev", "/sys", "/tmp", "/run", "/home")


@dataclass(frozen=True, slots=True)
class OciInputs:
    sandbox_id: str
    workspace: Path
    owner_uid: int
    owner_gid: int
    agent_dir: Path
    python: str
    masked_file: Path
    masked_dir: Path
    passwd_file: Path
    agent_args: tuple[str, ...]
    limits: LimitPlan | None = None
    """The box's limits (:func:`corral.backends.limits.plan_limits`); None: the policy's,
    planned as on a host with every controller."""
    extra_binds: tuple[Bind, ...] = ()
    """Binds a backend-neutral part asks for (the network directory of ``corral.net``)."""
    netns_path: str | None = None
    """An existing network namespace to join; None: a new, empty one (every mode today:
    ``full`` mode attaches user-mode NAT to it before the agent starts)."""
    userns_path: str | None = None
    """The box's user namespace, made beforehand with its id maps by a host uid of its own
    (:func:`corral.backends.host.ucounts.make_userns`); None: the runtime makes one."""
    root_uid: int = HOST_UID_BASE
    """Host uid (and gid) of box root: the namespace's owner where corral made it."""
    host_mounts: tuple[str, ...] = ()
    """Mount points of the host: those under a read-only bind are made read-only too."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Idmapped mount points replacing ``allow_write`` and ``mounts`` host paths."""
    seccomp_file: str | None = None
    """gVisor: the compiled filter (host path), bound at :data:`GUEST_SECCOMP`."""
    compat_library: str | None = None
    """gVisor: the compatibility library (host path), bound at :data:`GUEST_COMPAT`."""
    rootless: tuple[tuple[int, int, int], ...] | None = None
    """A rootless box (corral run by an ordinary user, :mod:`corral.backends.oci.rootless`):
    its ``(box id, runtime's id, count)`` maps, the same for uids and gids. The box then has
    no cgroup of the runtime's making (no ``linux.resources``: corral makes one in a delegated
    subtree, or the agent's rlimits bound it), and with a single id mapped (no subordinate
    ids) box root runs commands itself, so it keeps no capability and its home is box root's."""
    image_root: Path | None = None
    """The root directory of ``policy.image`` (None: the host's system): its top-level
    entries bound read-only on the bundle's empty root, or (``image_writable``) the box's
    overlay (:mod:`corral.backends.host.overlay`) as the container's root itself."""
    image_writable: bool = False
    """``image_root`` is the box's writable overlay (``filesystem.root_size``)."""
    hidden: HiddenPython | None = None
    """With ``image_root``: how the agent's interpreter runs from the host's /usr, bound
    read-only at :data:`HOST_PREFIX` (the image may have no Python)."""
    root_commands: bool = False
    """Commands run as box root (``policy.user = "root"``): the agent keeps
    :data:`~corral.backends.users.ROOT_CAPS` (of the box's own namespace) for them."""
    others: int = HOST_UID_BASE
    """Host id of the box's ids but 0 and 1000 (a block of the box's own for root boxes,
    :func:`corral.backends.users.own_block`)."""
    gvisor: bool = False
    """runsc: gVisor's file server runs as the box's root in the box's user namespace, so
    every mount point is made in the root dir (it may not write there), and masks over host
    paths it may not open are left out (out of the box's reach anyway); its own sysfs in
    every network mode; the seccomp filter comes from the agent (see :func:`oci_bundle`)."""


@dataclass(frozen=True, slots=True)
class OciBundle:
    config: dict[str, Any]
    dirs: tuple[tuple[str, int], ...]
    """Guest paths and modes of directories to create in the root dir (parents first).

    runc gives a tmpfs the mode of the directory it covers, so /tmp's must be 1777."""
    files: tuple[str, ...]
    """Guest paths to create as empty files (mount points of files)."""
    symlinks: tuple[Symlink, ...]


def _bind(entry: Bind, host: HostView) -> dict[str, Any]:
    # rbind: submounts come along (and are made read-only one by one, see _submounts);
    # nosuid/nodev: a setuid binary or a device node in a bound tree grants nothing.
    options = ["rbind", "rw" if entry.writable else "ro", "nosuid", "nodev"]
    return {"destination": entry.dest, "type": "bind", "source": entry.source, "options": options}


def _tmpfs(
    dest: str, mode: str, size: int | None = None, extra: Iterable[str] = ()
) -> dict[str, Any]:
    options = ["nosuid", "nodev", f"mode={mode}", *extra]
    if size is not None:
        options.append(f"size={size}")
    return {"destination": dest, "type": "tmpfs", "source": "tmpfs", "options": options}


def _submounts(binds: Iterable[Bind], host_mounts: Iterable[str]) -> list[Bind]:
    """Host mount points below read-only binds, bound read-only over themselves.

    A runtime applies ``ro`` to the top of an ``rbind`` only (recursive read-only needs
    runc 1.2 and kernel 5.12), so a writable submount would stay writable inside.
    """
    roots = [b.dest for b in binds if not b.writable and b.source == b.dest]
    return [
        Bind(point, point)
        for point in sorted(host_mounts, key=lambda p: (p.count("/"), p))
        if any(point.startswith(root + "/") for root in roots)
    ]


MQUEUE_MOUNT: dict[str, Any] = {
    "destination": "/dev/mqueue",
    "type": "mqueue",
    "source": "mqueue",
    "options": ["nosuid", "noexec", "nodev"],
}
"""The box's own IPC namespace's message queues (:data:`corral.backends.landlock.MQUEUE`)."""


def _system_mounts(
    policy: Policy, own_netns: bool = True, user: int = BOX_UID
) -> list[dict[str, Any]]:
    tmp_size = policy.filesystem.tmp_size
    # The box's own sysfs (it owns its network namespace), read-only: no cgroup or other
    # submounts of the host's /sys come along. A joined namespace (full mode) belongs to
    # another user namespace, and only its owner may mount sysfs: then the host's /sys is
    # bound read-only instead, submounts included, as the bwrap box sees it.
    sysfs = {
        "destination": "/sys",
        "type": "sysfs",
        "source": "sysfs",
        "options": ["nosuid", "nodev", "noexec", "ro"],
    }
    return [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "nodev", "noexec"],
        },
        _tmpfs("/dev", "755", 1 << 20, ["strictatime"]),
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": [
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                f"max={PTY_MAX}",  # the kernel's PTY pool is shared with every box
            ],
        },
        _tmpfs("/dev/shm", "1777", tmp_size),  # as bwrap's (whose tmpfs takes no noexec)
        *([sysfs] if own_netns else []),
        _tmpfs("/tmp", "1777", tmp_size),
        _tmpfs("/run", "755", tmp_size),
        _tmpfs("/home", "755", tmp_size),
        _tmpfs(GUEST_HOME, "755", tmp_size, [f"uid={user}", f"gid={user}"]),  # the user's
    ]


def _resources(plan: LimitPlan) -> dict[str, Any]:
    """``linux.resources``: the planned limits the host's cgroups enforce, as planned."""
    res: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if plan.mechanism == "none":
        return res
    if plan.memory_max is not None and "memory_bytes" not in plan.unenforced:
        res["memory"] = {"limit": plan.memory_max}
        if plan.swap_capped:
            # OCI's swap is memory + swap: equal to the limit means no swap at all.
            res["memory"]["swap"] = plan.memory_max
    if plan.pids_max is not None and "max_pids" not in plan.unenforced:
        res["pids"] = {"limit": plan.pids_max}
    if plan.cpu_quota_us is not None and "cpu_quota" not in plan.unenforced:
        res["cpu"] = {"quota": plan.cpu_quota_us, "period": plan.cpu_period_us}
    return res


def _mount_points(
    mounts: list[dict[str, Any]], host_roots: set[str], host: HostView, everywhere: bool = False
) -> tuple[list[tuple[str, int]], list[str]]:
    """Directories and files to make in the root dir for the mounts.

    Every top-level mount point is made here, since the runtime, as the box's
    unprivileged root, cannot write the root directory. Deeper ones inside the box's own
    mounts are made by the runtime; those inside host binds exist on the host (or fail, as
    with bwrap); any other (a shared mount at ``/data/in``) gets its parents made here.
    ``everywhere``: inside the box's own mounts too (gVisor's file server makes bind mount
    points in the root dir, below /run's tmpfs as well, and may not write there).
    """
    dirs: dict[str, int] = {}
    files: dict[str, None] = {}
    skipped = host_roots if everywhere else host_roots | set(_OWN_MOUNTS)
    for mount in mounts:
        dest = os.path.normpath(mount["destination"])
        parts = dest.strip("/").split("/")
        if len(parts) > 1 and "/" + parts[0] in skipped:
            continue
        for i in range(1, len(parts)):
            dirs.setdefault("/" + "/".join(parts[:i]), 0o755)
        if mount["type"] == "bind" and not host.isdir(mount["source"]):
            files[dest] = None
        else:
            modes = [o[5:] for o in mount.get("options", ()) if o.startswith("mode=")]
            dirs[dest] = int(modes[-1], 8) if modes else 0o755
    return list(dirs.items()), [f for f in files if f not in dirs]


def _other_can_open(path: str) -> bool:
    """Whether a host uid with no grants (gVisor's file server: box root, an unmapped host
    uid to every host file) can open ``path``: readable by others below searchable dirs."""
    try:
        if not os.stat(path).st_mode & 0o004:
            return False
        parent = os.path.dirname(os.path.normpath(path))
        while parent not in ("/", ""):
            if not os.stat(parent).st_mode & 0o001:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return True  # not on this host (pure tests): keep the mask
    return True


def _reachable_masks(binds: list[Bind], masks: set[str]) -> list[Bind]:
    """The binds without the masks of host paths gVisor's file server cannot open.

    It opens a mask's destination to mount over it, as box root: an unmapped host uid, so
    a host path only root may read (``/etc/shadow``) fails the whole box. Such a path is out
    of the box's reach already, for the same reason: every file a gVisor box reads, its file
    server opens. Masks inside shared paths (their files are the box user's) always stay."""
    shared = [b.dest for b in binds if b.writable or b.source not in masks | {b.dest}]
    return [
        b
        for b in binds
        if b.source not in masks
        or any(b.dest == d or b.dest.startswith(d.rstrip("/") + "/") for d in shared)
        or _other_can_open(b.dest)
    ]


def _roots(policy: Policy, inp: OciInputs, host: HostView) -> list[Bind | Symlink]:
    """The entries of the box's root: the host's system, or the image's top-level entries
    with the box's passwd over the image's where it has one; none on a writable image root
    (the overlay is the root, with its own ``/etc/passwd``: box root may ``useradd``)."""
    if inp.image_root is None:
        return [*root_entries(policy, inp.python, host), *passwd_binds(policy, inp.passwd_file)]
    if inp.image_writable:
        return []
    roots = image_entries(inp.image_root)
    for b in passwd_binds(policy, inp.passwd_file):
        if image_has_file(inp.image_root, b.dest):
            roots.append(b)
    return roots


def oci_bundle(policy: Policy, inp: OciInputs, host: HostView | None = None) -> OciBundle:
    """Translate a policy into the OCI bundle (config.json and root dir) of one box."""
    host = host or HostView(placeholder=safepath.make_dirs)
    roots = _roots(policy, inp, host)
    # The runtime mounts its own /proc, /dev and /sys (bwrap binds the host's /sys).
    root_binds = [e for e in roots if isinstance(e, Bind) and e.dest not in _OWN_MOUNTS]
    # gVisor's sysfs is its own kernel's, so it is mounted in every network mode.
    own_sysfs = inp.netns_path is None or inp.gvisor
    if not own_sysfs:
        root_binds.append(Bind("/sys", "/sys"))
    binds = [
        *root_binds,
        *_submounts(root_binds, inp.host_mounts),
        Bind(str(inp.agent_dir), GUEST_AGENT_DIR),
        *inp.extra_binds,
        *([Bind(inp.seccomp_file, GUEST_SECCOMP)] if inp.seccomp_file else []),
        *([Bind(inp.compat_library, GUEST_COMPAT)] if inp.compat_library else []),
        *([Bind(inp.hidden.usr, HOST_PREFIX + "/usr")] if inp.hidden else []),
    ]
    shared = policy_binds(policy, inp.workspace, inp.masked_file, inp.masked_dir, host, inp.sources)
    if inp.image_root is not None:  # masks of the host's own files: not in an image's root
        shared = on_shared_paths(policy, shared)
    binds += shared
    if inp.gvisor:
        binds = _reachable_masks(binds, {str(inp.masked_file), str(inp.masked_dir)})
    single = inp.rootless is not None and len(inp.rootless) == 1  # box root runs commands
    user = 0 if single else BOX_UID
    mounts = _system_mounts(policy, own_sysfs, user)
    if inp.image_root is not None:  # the agent and the host's /usr: box root's alone
        mounts.append(_tmpfs(posixpath.dirname(GUEST_AGENT_DIR), "700"))
    mounts += [_bind(b, host) for b in binds]
    if not inp.gvisor:  # the box's POSIX message queues, where Landlock can name them
        mounts.insert(3, MQUEUE_MOUNT)
    if not own_sysfs:  # the host's cgroupfs lists every box's cgroup: cover it
        mounts.append(_tmpfs(CGROUP_DIR, "555", 4096, ["ro"]))
    host_roots = {b.dest for b in root_binds}
    dirs, files = _mount_points(mounts, host_roots, host, everywhere=inp.gvisor)
    limits = inp.limits or plan_limits(policy.limits, Capabilities("cgroup v1"))
    namespaces: list[dict[str, str]] = [{"type": t} for t in NAMESPACES]
    if inp.userns_path is not None:  # made by corral, owned by the box's own host uid
        namespaces[NAMESPACES.index("user")]["path"] = inp.userns_path
    network = {"type": "network"}
    if inp.netns_path is not None:
        network["path"] = inp.netns_path
    namespaces.append(network)
    caps = [] if single else list(AGENT_CAPS)
    if inp.root_commands and not single:
        caps += ROOT_CAPS
    interpreter = inp.hidden.argv if inp.image_root is not None and inp.hidden else (inp.python,)
    config: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [*interpreter, "-I", "-S", f"{GUEST_AGENT_DIR}/agent.py", *inp.agent_args],
            "env": [f"PATH={SYSTEM_PATH}", "LANG=C.UTF-8"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
                "inheritable": [],
                "ambient": [],
            },
            # Per-command rlimits are applied by the agent; the agent itself never dumps.
            "rlimits": [{"type": "RLIMIT_CORE", "hard": 0, "soft": 0}],
            "noNewPrivileges": True,
        },
        "root": (
            {"path": str(inp.image_root), "readonly": False}
            if inp.image_root is not None and inp.image_writable
            else {"path": "rootfs", "readonly": True}
        ),
        "hostname": "corral",
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "uidMappings": _mappings(inp.owner_uid, inp.root_uid, inp.others),
            "gidMappings": _mappings(inp.owner_gid, inp.root_uid, inp.others),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(PROC_READ_ONLY),
            "seccomp": seccomp.oci_seccomp(policy.security.preset),
            "resources": _resources(limits),
            "cgroupsPath": f"/{PARENT}/{inp.sandbox_id}",
        },
    }
    if inp.userns_path is not None:
        # runc sets these with prlimit from outside the box, which a host root without
        # CAP_SYS_RESOURCE may not do in a namespace it does not own; the agent sets core 0
        # on itself first thing (and on every command).
        del config["process"]["rlimits"]
    if inp.rootless is not None:
        maps = [{"containerID": b, "hostID": h, "size": n} for b, h, n in inp.rootless]
        config["linux"].update(uidMappings=maps, gidMappings=maps)
        # No cgroup of its own: the runtime may not make one (crun is told so, runc's
        # rootless mode skips what it may not write); the agent's rlimits bound commands.
        del config["linux"]["resources"], config["linux"]["cgroupsPath"]
    if inp.gvisor:
        # runsc's OCI seccomp turns every errno into EPERM and is off by default: the agent
        # installs corral's compiled filter on itself instead, which gVisor's kernel enforces.
        del config["linux"]["seccomp"]
    return OciBundle(
        config=config,
        dirs=tuple(dirs),
        files=tuple(files),
        symlinks=tuple(e for e in roots if isinstance(e, Symlink)),
    )


def _mappings(owner: int, root: int, others: int = HOST_UID_BASE) -> list[dict[str, int]]:
    return [
        {"containerID": box, "hostID": host, "size": count}
        for box, host, count in id_ranges(owner, root, others)
    ]


_FRESH_TYPES = frozenset({"tmpfs", "proc", "sysfs", "devpts", "mqueue"})
"""Mount types that make a new filesystem: what lies below their destination is not the
root's."""


def root_destinations(mounts: list[dict[str, Any]]) -> list[str]:
    """The destinations of ``mounts`` the runtime resolves (and makes when missing) in the
    box's root: not those beneath a new filesystem mounted before them (``/dev/pts`` in the
    box's ``/dev`` tmpfs, ``/run/corral/agent`` in ``/run``)."""
    dests: list[str] = []
    fresh: list[str] = []
    for mount in mounts:
        dest = os.path.normpath(str(mount.get("destination") or "/"))
        if dest == "/" or any(dest.startswith(f.rstrip("/") + "/") for f in fresh):
            continue
        dests.append(dest)
        if mount.get("type") in _FRESH_TYPES:
            fresh.append(dest)
    return dests
