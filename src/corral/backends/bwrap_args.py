"""``Policy -> bwrap argv``: a pure function, so every policy field is unit-tested.

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

The user namespace is created by bwrap but its uid/gid maps are written by the host (see
``bwrap.py``) while bwrap waits on ``--userns-block-fd``: that is what lets the agent be the
box's root while mapping to an unprivileged host uid, and commands run as a second uid.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from corral.policy import Policy

GUEST_AGENT_DIR = "/run/corral/agent"
GUEST_HOME = "/home/user"
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


@dataclass(frozen=True, slots=True)
class BwrapFds:
    """File descriptor numbers bwrap inherits."""

    info: int
    userns_block: int
    seccomp: int


@dataclass(frozen=True, slots=True)
class BwrapInputs:
    workspace: Path
    agent_dir: Path
    python: str
    masked_file: Path
    """An empty host file with mode 000, bound over denied files."""
    masked_dir: Path
    """An empty host directory with mode 000, bound over denied directories."""
    passwd_file: Path
    """An /etc/passwd naming the box's users (used by the minimal root)."""
    fds: BwrapFds
    agent_args: tuple[str, ...]


def expand(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return os.path.normpath(home + path[1:])
    return os.path.normpath(path)


# Top-level host directories a box never sees: it gets its own of each (or none).
PRIVATE_TOP = frozenset({"proc", "dev", "tmp", "run", "home", "lost+found", "var/run"})


def _root_args(policy: Policy, inp: BwrapInputs, host: HostView) -> list[str]:
    """The box's root is bwrap's tmpfs (so mount points like /workspace can be made), with
    each top-level host entry bound read-only on it; ``--remount-ro /`` seals it at the end."""
    if policy.filesystem.inherit_readable:
        args = []
        for name in sorted(host.listdir("/")):
            path = "/" + name
            if name in PRIVATE_TOP or path == policy.workdir:
                continue
            if host.islink(path):
                args += ["--symlink", host.readlink(path), path]
            else:
                args += ["--ro-bind", path, path]
        return args
    # bwrap makes missing mount points 0700 as the box's root: /etc must be listable.
    args = ["--perms", "0755", "--dir", "/etc"]
    for link in MERGED_USR_LINKS:
        if host.islink(link):
            args += ["--symlink", host.readlink(link), link]
        elif host.isdir(link):
            args += ["--ro-bind", link, link]
    for path in MINIMAL_RO_DIRS + MINIMAL_RO_FILES:
        if host.lexists(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind", str(inp.passwd_file), "/etc/passwd"]
    if not inp.python.startswith("/usr/"):
        # An interpreter outside /usr (pyenv, a venv's base) must be visible too.
        prefix = str(Path(inp.python).resolve().parent.parent)
        args += ["--ro-bind", prefix, prefix]
    return args


def _mask_args(policy: Policy, host: HostView, inp: BwrapInputs) -> list[str]:
    args: list[str] = []
    for raw in policy.filesystem.deny_read:
        guest = _guest_path(raw, policy, host)
        source = _host_path(guest, policy, inp)
        if not host.lexists(source):
            continue  # nothing to hide, and bwrap cannot create a mount point on a ro root
        mask = inp.masked_dir if host.isdir(source) else inp.masked_file
        args += ["--ro-bind", str(mask), guest]
    return args


def bwrap_argv(policy: Policy, inp: BwrapInputs, host: HostView | None = None) -> list[str]:
    """Translate a policy into the full bwrap command line that starts the guest agent."""
    host = host or HostView()
    fs = policy.filesystem
    args = [
        "bwrap",
        "--unshare-user",
        "--userns-block-fd",
        str(inp.fds.userns_block),
        "--info-fd",
        str(inp.fds.info),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        "--unshare-net",  # every network mode starts from an empty namespace
        "--hostname",
        "corral",
        "--die-with-parent",
        "--new-session",
        "--uid",
        "0",
        "--gid",
        "0",
        # bwrap runs unprivileged, so it drops every capability but these: the agent needs
        # exactly these to run commands as the box's user, and they are lost on that uid
        # change, so no command ever holds a capability.
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
    ]
    args += _root_args(policy, inp, host)
    args += ["--dev", "/dev", "--proc", "/proc"]
    args += ["--size", str(fs.tmp_size), "--tmpfs", "/tmp"]
    args += ["--tmpfs", "/run", "--tmpfs", "/home", "--dir", GUEST_HOME]
    args += ["--chmod", "1777", "/tmp", "--chmod", "0777", GUEST_HOME]
    args += ["--ro-bind", str(inp.agent_dir), GUEST_AGENT_DIR]
    args += ["--bind", str(inp.workspace), policy.workdir]
    for raw in fs.allow_write:
        path = expand(raw, host.home)
        args += ["--bind", path, path]
    for mount in fs.mounts:
        flag = "--bind" if mount.mode == "rw" else "--ro-bind"
        args += [flag, str(mount.host), mount.guest]
    for raw in fs.deny_write:
        guest = _guest_path(raw, policy, host)
        source = _host_path(guest, policy, inp)
        if host.lexists(source):
            args += ["--ro-bind", source, guest]
    args += _mask_args(policy, host, inp)
    args += ["--remount-ro", "/"]
    args += ["--seccomp", str(inp.fds.seccomp)]
    args += ["--chdir", "/", "--"]  # the agent needs no cwd; commands get theirs
    args += [inp.python, "-I", "-S", f"{GUEST_AGENT_DIR}/agent.py", *inp.agent_args]
    return args


def _guest_path(raw: str, policy: Policy, host: HostView) -> str:
    """deny_* entries may be relative to the workspace (``.git``), absolute, or under ``~``."""
    if raw.startswith(("/", "~")):
        return expand(raw, host.home)
    return os.path.normpath(os.path.join(policy.workdir, raw))


def _host_path(guest: str, policy: Policy, inp: BwrapInputs) -> str:
    """Where a guest path comes from on the host (only the workspace is moved)."""
    if guest == policy.workdir or guest.startswith(policy.workdir + "/"):
        return str(inp.workspace) + guest[len(policy.workdir) :]
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
    env.update(policy.env)
    return env
