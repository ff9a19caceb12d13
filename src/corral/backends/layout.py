"""The layout of a box (``Policy`` -> mounts), the same for every backend: pure, so every
policy field is unit-tested, and each backend only renders it (bwrap argv, OCI mounts, the
microVM's guest mount script).

Layout of a box (guest paths)::

    /                  a read-only tmpfs holding the host *system* read-only
                       (inherit_readable: :data:`SYSTEM_TOP`, /var/lib/dpkg) or only what
                       sh/python3/node need; host data (/root, /srv, /mnt, /media, the rest
                       of /var, any other top-level directory) is not there at all
    /etc/passwd /etc/group  the box's own (:mod:`corral.backends.users`)
    /proc /dev         the box's own procfs (its PID namespace) and a minimal devtmpfs
    /tmp               private tmpfs, size-capped
    /run               private tmpfs: hides the host's sockets (docker, dbus, ...), which
                       stay connectable on a read-only bind
    /home              private tmpfs holding only /home/user (HOME), so other homes are hidden
    /run/corral/agent  the guest agent, read-only
    <workdir>          the workspace, read-write (default /workspace)
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from corral.backends.users import GUEST_HOME
from corral.errors import PolicyError
from corral.net import env as net_env
from corral.policy import Policy

GUEST_AGENT_DIR = "/run/corral/agent"
BOX_EMAIL = "user@corral.invalid"
"""The box user's e-mail address (``EMAIL``): git commits work out of the box."""
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What a minimal root needs to run sh, python3 and node: the usual merged-/usr layout.
MINIMAL_RO_DIRS = ("/usr", "/etc/alternatives", "/etc/ssl", "/etc/ca-certificates")
MINIMAL_RO_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/hosts")
MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
SYSTEM_TOP = frozenset(
    {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "opt", "sys"}
    | {"nix", "gnu", "snap"}  # the stores of Nix, Guix and snapd: software, not data
)
"""Top-level host entries of the system view (``inherit_readable``): what programs run
from. Everything else at the top of the host (``/root``, ``/srv``, ``/mnt``, ``/media``,
``/boot``, other projects' directories) is host *data*: absent unless the policy mounts it."""
VAR_SYSTEM = ("/var/lib/dpkg",)
"""The part of the host's /var programs read (dpkg's database: dpkg -l, apt, pip's
``--system`` checks); the rest of /var (logs, mail, spools, databases) is host data."""


@dataclass(frozen=True, slots=True)
class Place:
    """Where a masked object lies now: ``rel`` below writable area number ``area`` (in the
    order of :func:`writable_areas`: the workspace, ``allow_write``, rw ``mounts``)."""

    area: int
    rel: str
    is_dir: bool


@dataclass(frozen=True, slots=True)
class HostView:
    """What the translation needs to know about the host (injected so tests stay pure)."""

    home: str = field(default_factory=lambda: os.path.expanduser("~"))
    listdir: Callable[[str], list[str]] = os.listdir
    lexists: Callable[[str], bool] = os.path.lexists
    isdir: Callable[[str], bool] = os.path.isdir
    readlink: Callable[[str], str] = os.readlink
    islink: Callable[[str], bool] = os.path.islink
    owner: Callable[[str], tuple[int, int]] = lambda p: _owner(p)
    searchable: Callable[[str, int, int], bool] = lambda p, u, g: _searchable(p, u, g)
    ident: Callable[[str], tuple[int, int] | None] = lambda p: _ident(p)
    """(st_dev, st_ino) of a host path, following the host's links; None if it is missing."""
    moved: Mapping[str, tuple[Place, ...]] = field(default_factory=dict)
    """deny entry (as spelled) -> where else its masked objects lie in the writable areas
    now (renamed parents, hard links): :func:`corral.backends.host.maskfollow.locate`."""
    placeholder: Callable[[str, str], None] | None = None
    """Make the empty directory ``rel`` beneath the writable ``area``, following no link
    (:func:`corral.backends.host.safepath.make_dirs`, given by the backends: layout imports
    no host module)."""


def _ident(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _owner(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0)  # no workspace yet (pure tests): as for root, every path is reachable
    return (st.st_uid, st.st_gid)


def _searchable(path: str, uid: int, gid: int) -> bool:
    """Whether the box can reach ``path`` at all: box uid 1000 maps to ``uid``, and no other
    host user is mapped except root when the workspace owner is root. A path below a directory
    the box can't search needs no mask, and bwrap couldn't make the mask's mount point."""
    if uid == 0:
        return True
    parent = os.path.dirname(os.path.normpath(path))
    while parent not in ("/", ""):
        try:
            st = os.stat(parent)
        except OSError:
            return True
        mode = st.st_mode
        if not (
            mode & 0o001
            or (st.st_uid == uid and mode & 0o100)
            or (st.st_gid == gid and mode & 0o010)
        ):
            return False
        parent = os.path.dirname(parent)
    return True


def expand(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return os.path.normpath(home + path[1:])
    return os.path.normpath(path)


# Kernel knobs under /proc that go by file mode alone: commands run as the workspace owner's
# host uid, which is root when corral runs as root, and a root-owned 0644 sysctl such as
# kernel.core_pattern would then be writable (a pipe there runs a program as host root).
# bwrap covers these only when its own sandbox root could write them, which ours (an
# unprivileged host uid) cannot, so it skips them: bind them read-only ourselves.
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
# The host's cgroupfs below a bound host /sys lists every box's cgroup (ids, memory use):
# a box that sees the host's /sys gets an empty read-only tmpfs here instead.
CGROUP_DIR = "/sys/fs/cgroup"
# The box's own devpts instance holds at most this many PTYs. The kernel's pool
# (kernel.pty.max less kernel.pty.reserve, 3072 by default) is shared by every box: at 64
# each, 48 boxes at full use fit in it (at 256, twelve did), and a start beyond that is
# refused (host.devpts.refuse_beyond_pool).
PTY_MAX = 64

# Top-level host directories a box never sees: it gets its own of each (or none).
PRIVATE_TOP = frozenset({"proc", "dev", "tmp", "run", "home", "lost+found", "var/run"})


@dataclass(frozen=True, slots=True)
class Bind:
    """One bind mount of a box's layout (the same layout for every backend)."""

    source: str
    dest: str
    writable: bool = False


@dataclass(frozen=True, slots=True)
class Symlink:
    """A symbolic link made in the box: ``dest`` pointing at ``target``."""

    target: str
    dest: str


VAR_LINKS = (("/run", "/var/run"), ("/run/lock", "/var/lock"), ("/tmp", "/var/tmp"))
"""``(target, link)``: the system view's /var otherwise holds only these links, to the box's
own /run and /tmp."""


def image_entries(rootfs: Path, writable: bool = False) -> list[Bind | Symlink]:
    """A box root made of an image's root directory: each of its top-level directories
    bound (read-only unless ``writable``: a writable root's overlay) and its top-level
    symlinks copied (``bin -> usr/bin``), never followed on the host; the box's own
    ``/proc``, ``/dev``, ``/tmp``, ``/run`` and ``/home`` are not taken from it."""
    entries: list[Bind | Symlink] = []
    with os.scandir(rootfs) as listing:
        for entry in sorted(listing, key=lambda e: e.name):
            if entry.name in PRIVATE_TOP or entry.name == "sys":
                continue
            if entry.is_symlink():
                entries.append(Symlink(os.readlink(entry.path), "/" + entry.name))
            elif entry.is_dir(follow_symlinks=False):
                entries.append(Bind(entry.path, "/" + entry.name, writable))
    return entries


def root_entries(policy: Policy, python: str, host: HostView) -> list[Bind | Symlink]:
    """The host side of the box's root: the host *system* read-only (``inherit_readable``:
    each top-level entry of :data:`SYSTEM_TOP` there is, :data:`VAR_SYSTEM`), or only what
    sh, python3 and node need. Host data is never part of it (see :data:`SYSTEM_TOP`)."""
    entries: list[Bind | Symlink] = []
    if policy.filesystem.inherit_readable:
        for name in sorted(host.listdir("/")):
            path = "/" + name
            if name not in SYSTEM_TOP or path == policy.workdir:
                continue
            if host.islink(path):
                entries.append(Symlink(host.readlink(path), path))
            else:
                entries.append(Bind(path, path))
        if not host.islink("/var"):
            entries += [Bind(p, p) for p in VAR_SYSTEM if host.isdir(p)]
            entries += [Symlink(target, link) for target, link in VAR_LINKS]
        if not _on_system_view(python):
            entries.append(_interpreter_prefix(python))
        return entries
    for link in MERGED_USR_LINKS:
        if host.islink(link):
            entries.append(Symlink(host.readlink(link), link))
        elif host.isdir(link):
            entries.append(Bind(link, link))
    entries += [Bind(p, p) for p in MINIMAL_RO_DIRS + MINIMAL_RO_FILES if host.lexists(p)]
    if not python.startswith("/usr/"):
        # An interpreter outside /usr (pyenv, a venv's base) must be visible too.
        entries.append(_interpreter_prefix(python))
    return entries


def _interpreter_prefix(python: str) -> Bind:
    """The installation the agent's interpreter belongs to (``<prefix>/bin/python3``)."""
    prefix = str(Path(python).resolve().parent.parent)
    return Bind(prefix, prefix)


def _on_system_view(path: str) -> bool:
    top = path.strip("/").split("/")[0]
    return top in SYSTEM_TOP or any(_within(path, p) for p in VAR_SYSTEM)


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def on_root(path: str, policy: Policy) -> bool:
    """Whether the host ``path`` appears in the box at its own path through the box's root
    (the system view or the minimal root), before any policy bind."""
    if policy.filesystem.inherit_readable:
        return _on_system_view(path)
    minimal = ("/usr", *MERGED_USR_LINKS, *MINIMAL_RO_DIRS, *MINIMAL_RO_FILES)
    return any(_within(path, p) for p in minimal)


def passwd_binds(policy: Policy, passwd_file: Path) -> list[Bind]:
    """The box's own /etc/passwd and /etc/group (:func:`corral.backends.users.passwd_text`,
    :func:`~corral.backends.users.group_text`: ``group`` beside ``passwd_file``), on every
    root: the box user is ``user`` (as ``USER`` says), never the host's name for its uid, and
    the host's accounts are not listed."""
    del policy  # the same on every root
    return [
        Bind(str(passwd_file), "/etc/passwd"),
        Bind(str(passwd_file.with_name("group")), "/etc/group"),
    ]


def policy_binds(
    policy: Policy,
    workspace: Path,
    masked_file: Path,
    masked_dir: Path,
    host: HostView,
    sources: Mapping[str, str] | None = None,
) -> list[Bind]:
    """The workspace, extra writable paths, shared mounts, then the read-only and masked
    paths that cover them, in mount order. ``sources`` replaces host paths of
    ``allow_write`` and ``mounts`` (by their idmapped mount points)."""
    fs = policy.filesystem
    src = sources or {}
    host = _looking_once(host)
    binds = [Bind(str(workspace), policy.workdir, writable=True)]
    for raw in fs.allow_write:
        path = expand(raw, host.home)
        binds.append(Bind(src.get(path, path), path, writable=True))
    binds += [
        Bind(src.get(str(m.host), str(m.host)), m.guest, writable=m.mode == "rw") for m in fs.mounts
    ]
    bound = [b.dest for b in binds]

    def visible(guest: str) -> bool:
        return on_root(guest, policy) or any(_within(guest, d) for d in bound)

    # Where each bound host directory appears in the box: masks must follow the host
    # object (by st_dev/st_ino) to every path the box sees it at, not only the one spelled.
    shown = [(b.source, b.dest) for b in binds]  # read-only mounts show it too
    writable = [b for b in binds if b.writable]  # in the order of writable_areas()
    areas = [(host_path(b.dest, policy, workspace), b.dest) for b in binds if b.writable]
    for raw in fs.deny_write:
        guest = guest_path(raw, policy, host)
        source = host_path(guest, policy, workspace)
        _no_link_below("deny_write", raw, source, areas, host)
        if not host.lexists(source):
            area = _area(source, areas)
            if area is None:
                continue  # on the read-only root: nothing can be written there anyway
            # Not there yet: the box must not create it. An empty directory, masked read-only.
            if host.placeholder is None:
                raise PolicyError(f"filesystem.deny_write {raw!r}: {source} does not exist")
            host.placeholder(area[0], os.path.relpath(source, area[0]))
            binds.append(Bind(str(masked_dir), guest))
            continue
        for dest in _everywhere(source, guest, shown, host):
            if dest != guest or visible(guest):  # a read-only bind would *show* hidden data
                binds.append(Bind(source, dest))
    # The objects renamed or linked elsewhere in a writable area (found by inode).
    binds += _moved(fs.deny_write, host, writable, shown, lambda place, there: there)
    uid, gid = host.owner(str(workspace))
    for raw in fs.deny_read:
        guest = guest_path(raw, policy, host)
        source = host_path(guest, policy, workspace)
        _no_link_below("deny_read", raw, source, areas, host)
        if not host.lexists(source):
            continue  # nothing to hide, and no mount point can be made on a read-only root
        mask = str(masked_dir if host.isdir(source) else masked_file)
        dests = _everywhere(source, guest, shown, host)
        shared = any(_within(guest, d) for d in bound)  # a bind's files: always masked
        if not shared and (not on_root(guest, policy) or not host.searchable(source, uid, gid)):
            dests.remove(guest)  # not in the box at its own path, or out of reach there
        binds += [Bind(mask, dest) for dest in dests]
    masks = (str(masked_file), str(masked_dir))
    binds += _moved(fs.deny_read, host, writable, shown, lambda place, _: masks[place.is_dir])
    return binds


def _moved(
    raws: tuple[str, ...],
    host: HostView,
    writable: list[Bind],
    shown: list[tuple[str, str]],
    source: Callable[[Place, str], str],
) -> list[Bind]:
    """Binds at each place where a masked object of ``raws`` lies now besides its own path
    (:attr:`HostView.moved`), and wherever a share shows that place."""
    binds = []
    for raw in raws:
        for place in host.moved.get(raw, ()):
            area = writable[place.area]
            there = posixpath.join(area.source, place.rel)
            at = posixpath.join(area.dest, place.rel)
            binds += [Bind(source(place, there), d) for d in _everywhere(there, at, shown, host)]
    return binds


def _area(path: str, areas: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The writable (host directory, guest path) holding the host ``path``, or None."""
    for source, dest in areas:
        if path == source or path.startswith(source.rstrip("/") + "/"):
            return (source, dest)
    return None


def _no_link_below(
    field: str, raw: str, path: str, areas: list[tuple[str, str]], host: HostView
) -> None:
    """A mask inside a writable area whose path is (or passes through) a symlink would be
    bound wherever that link points: fail closed, naming the path, instead."""
    area = _area(path, areas)
    if area is None:
        return
    root = area[0].rstrip("/")
    current = root
    for part in os.path.relpath(path, root).split("/"):
        if part in ("", "."):
            continue
        current = f"{current}/{part}"
        if host.islink(current):
            # Named as the box sees it: the host path may be corral's own staging mount of
            # the workspace, which names nothing the user knows.
            seen = posixpath.join(area[1], os.path.relpath(current, root))
            raise PolicyError(
                f"filesystem.{field} {raw!r}: {seen} is a symlink in a writable area (left "
                "by an earlier box?); a mask cannot follow it: remove the link, or drop the entry"
            )
        if not host.lexists(current):
            return


def _looking_once(host: HostView) -> HostView:
    """``host`` whose ``ident`` stats each path once in this translation: every deny entry
    compares its ancestors (``/etc``, ``/``) with every bound directory, which statted the
    same few paths ~30 times a box start. Nothing outlives the call."""
    seen: dict[str, tuple[int, int] | None] = {}
    ident = host.ident

    def once(path: str) -> tuple[int, int] | None:
        if path not in seen:
            seen[path] = ident(path)
        return seen[path]

    return replace(host, ident=once)


def _everywhere(source: str, guest: str, shown: list[tuple[str, str]], host: HostView) -> list[str]:
    """Every guest path at which the host object ``source`` is visible: its own ``guest``
    path, plus its path below each writable bind whose host directory is one of its
    ancestors (compared by st_dev/st_ino: with workspace = $HOME, ``~/.ssh`` is also
    ``/workspace/.ssh``)."""
    dests = [guest]
    for spelled in dict.fromkeys([source, os.path.realpath(source)]):
        ancestors: list[str] = []
        parent = spelled
        while True:
            ancestors.append(parent)
            if parent in ("/", ""):
                break
            parent = os.path.dirname(parent)
        for bind_source, bind_dest in shown:
            wanted = host.ident(bind_source)
            if wanted is None:
                continue
            for ancestor in ancestors:
                if host.ident(ancestor) == wanted:
                    rest = os.path.relpath(spelled, ancestor)
                    dest = bind_dest if rest == "." else posixpath.join(bind_dest, rest)
                    if dest not in dests:
                        dests.append(dest)
                    break
    return dests


def on_shared_paths(policy: Policy, binds: list[Bind]) -> list[Bind]:
    """The binds of :func:`policy_binds` that lie on its shared paths (the workspace,
    ``allow_write``, ``mounts``: those come first), masks there included."""
    fs = policy.filesystem
    shared = [b.dest for b in binds[: 1 + len(fs.allow_write) + len(fs.mounts)]]
    return [
        b
        for b in binds
        if any(b.dest == d or b.dest.startswith(d.rstrip("/") + "/") for d in shared)
    ]


def writable_areas(policy: Policy, workspace: Path, home: str | None = None) -> list[str]:
    """Every host directory a box can write: the workspace, ``allow_write`` and rw mounts.
    Host code opens nothing there but through :mod:`corral.backends.host.safepath`."""
    home = home if home is not None else os.path.expanduser("~")
    areas = [str(workspace)]
    areas += [expand(raw, home) for raw in policy.filesystem.allow_write]
    areas += [str(m.host) for m in policy.filesystem.mounts if m.mode == "rw"]
    return areas


def shared_sources(policy: Policy, home: str | None = None) -> list[tuple[str, str]]:
    """(field, host path) of every ``allow_write`` path and ``mounts`` source."""
    home = home if home is not None else os.path.expanduser("~")
    fs = policy.filesystem
    named = [
        (f"filesystem.allow_write[{i}]", expand(p, home)) for i, p in enumerate(fs.allow_write)
    ]
    named += [(f"filesystem.mounts[{i}].host", str(m.host)) for i, m in enumerate(fs.mounts)]
    return named


def unplaceable_mount(policy: Policy, host: HostView | None = None) -> str | None:
    """Why a mount's guest path can't be made (its parent is a read-only host directory and
    it does not exist there), as a sentence naming the fix; None when all can be made."""
    host = host or HostView()
    if not policy.filesystem.inherit_readable:
        return None  # a minimal root is the box's own tmpfs: any path can be made
    for guest in [policy.workdir, *(m.guest for m in policy.filesystem.mounts)]:
        if host.lexists(guest):
            continue
        top = guest.strip("/").split("/")[0]
        parent = posixpath.dirname(guest)
        if top not in SYSTEM_TOP or parent == "/" or not host.lexists("/" + top):
            continue  # the box's own directories (/var, /srv, ...) are made as needed
        existing = parent
        while not host.lexists(existing):
            existing = posixpath.dirname(existing)
        return (
            f"cannot mount at {guest}: it does not exist and {existing} is the host's own "
            f"directory, read-only in the box; create {guest} on the host, or pick a guest "
            f"path under a new top-level directory (for example /data{guest})"
        )
    return None


def guest_path(raw: str, policy: Policy, host: HostView) -> str:
    """deny_* entries may be relative to the workspace (``.git``), absolute, or under ``~``."""
    if raw.startswith(("/", "~")):
        return expand(raw, host.home)
    return os.path.normpath(os.path.join(policy.workdir, raw))


def host_path(guest: str, policy: Policy, workspace: Path) -> str:
    """Where a guest path comes from on the host (only the workspace is moved)."""
    if guest == policy.workdir or guest.startswith(policy.workdir + "/"):
        return str(workspace) + guest[len(policy.workdir) :]
    return guest


def box_env(
    policy: Policy, term: str = "xterm-256color", image_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of every command: built from the policy, never the host's.
    ``image_env`` (a box on an image: its config's ``Env``) goes over the defaults; the
    network's variables and the policy's ``env`` go over it."""
    env = {
        "PATH": SYSTEM_PATH,
        "HOME": GUEST_HOME,
        "USER": "user",
        "LOGNAME": "user",
        "LANG": "C.UTF-8",
        "TERM": term,
        "TMPDIR": "/tmp",
        # git's author when neither the repository nor the policy's env names one (git reads
        # EMAIL after user.email, and the name from /etc/passwd: "box user").
        "EMAIL": BOX_EMAIL,
    }
    env.update(image_env or {})
    env.update(net_env.command_env(policy.network))
    env.update(policy.env)
    return env
