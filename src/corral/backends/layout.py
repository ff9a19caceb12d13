"""The layout of a box (``Policy`` -> mounts), the same for every backend: pure, so every
policy field is unit-tested, and each backend only renders it (bwrap argv, OCI mounts, the
microVM's guest mount script).

Layout of a box (guest paths)::

    /                  a read-only tmpfs holding each top-level host entry read-only
                       (inherit_readable) or only what sh/python3/node need
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
from dataclasses import dataclass, field
from pathlib import Path

from corral.backends.users import GUEST_HOME
from corral.net import env as net_env
from corral.policy import Policy

GUEST_AGENT_DIR = "/run/corral/agent"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What a minimal root needs to run sh, python3 and node: the usual merged-/usr layout.
MINIMAL_RO_DIRS = ("/usr", "/etc/alternatives", "/etc/ssl", "/etc/ca-certificates")
MINIMAL_RO_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf", "/etc/hosts")
MERGED_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


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
    target: str
    dest: str


def root_entries(policy: Policy, python: str, host: HostView) -> list[Bind | Symlink]:
    """The host side of the box's root: each top-level host entry read-only
    (``inherit_readable``), or only what sh, python3 and node need (then the box gets its
    own /etc/passwd too: :func:`passwd_binds`)."""
    entries: list[Bind | Symlink] = []
    if policy.filesystem.inherit_readable:
        for name in sorted(host.listdir("/")):
            path = "/" + name
            if name in PRIVATE_TOP or path == policy.workdir:
                continue
            if host.islink(path):
                entries.append(Symlink(host.readlink(path), path))
            else:
                entries.append(Bind(path, path))
        return entries
    for link in MERGED_USR_LINKS:
        if host.islink(link):
            entries.append(Symlink(host.readlink(link), link))
        elif host.isdir(link):
            entries.append(Bind(link, link))
    entries += [Bind(p, p) for p in MINIMAL_RO_DIRS + MINIMAL_RO_FILES if host.lexists(p)]
    if not python.startswith("/usr/"):
        # An interpreter outside /usr (pyenv, a venv's base) must be visible too.
        prefix = str(Path(python).resolve().parent.parent)
        entries.append(Bind(prefix, prefix))
    return entries


def passwd_binds(policy: Policy, passwd_file: Path) -> list[Bind]:
    """corral's /etc/passwd (:func:`corral.backends.users.passwd_text`) on a minimal root;
    nothing when the root inherits the host's /etc."""
    if policy.filesystem.inherit_readable:
        return []
    return [Bind(str(passwd_file), "/etc/passwd")]


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
    binds = [Bind(str(workspace), policy.workdir, writable=True)]
    for raw in fs.allow_write:
        path = expand(raw, host.home)
        binds.append(Bind(src.get(path, path), path, writable=True))
    binds += [
        Bind(src.get(str(m.host), str(m.host)), m.guest, writable=m.mode == "rw") for m in fs.mounts
    ]
    for raw in fs.deny_write:
        guest = guest_path(raw, policy, host)
        source = _host_path(guest, policy, workspace)
        if host.lexists(source):
            binds.append(Bind(source, guest))
    uid, gid = host.owner(str(workspace))
    for raw in fs.deny_read:
        guest = guest_path(raw, policy, host)
        source = _host_path(guest, policy, workspace)
        if not host.lexists(source):
            continue  # nothing to hide, and no mount point can be made on a read-only root
        if not host.searchable(source, uid, gid):
            continue  # out of the box's reach already (e.g. /root/.ssh for a user's workspace)
        binds.append(Bind(str(masked_dir if host.isdir(source) else masked_file), guest))
    return binds


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
        if top in PRIVATE_TOP or parent == "/" or not host.lexists("/" + top):
            continue
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


def _host_path(guest: str, policy: Policy, workspace: Path) -> str:
    """Where a guest path comes from on the host (only the workspace is moved)."""
    if guest == policy.workdir or guest.startswith(policy.workdir + "/"):
        return str(workspace) + guest[len(policy.workdir) :]
    return guest


def box_env(policy: Policy, term: str = "xterm-256color") -> dict[str, str]:
    """The environment of every command: built from the policy, never the host's."""
    env = {
        "PATH": SYSTEM_PATH,
        "HOME": GUEST_HOME,
        "USER": "user",
        "LOGNAME": "user",
        "LANG": "C.UTF-8",
        "TERM": term,
        "TMPDIR": "/tmp",
    }
    env.update(net_env.command_env(policy.network))
    env.update(policy.env)
    return env
