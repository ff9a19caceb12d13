"""``Policy -> bwrap argv``: a pure function, so every policy field is unit-tested.

The layout itself (which host entries, binds and masks) is :mod:`corral.backends.layout`'s,
shared with every backend; this module renders it as bwrap options.

The user namespace is created by bwrap but its uid/gid maps are written by the host (see
:mod:`corral.backends.bwrap.box`) while bwrap waits on ``--userns-block-fd``: that is what
lets the agent be the box's root while mapping to an unprivileged host uid, and commands run
as a second uid. bwrap then builds the mounts and waits on ``--block-fd`` until the host has
moved it into the box's cgroup.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from corral.backends.host import safepath
from corral.backends.host.overlay import image_has_file
from corral.backends.host.python import HOST_PREFIX, HiddenPython
from corral.backends.layout import (
    CGROUP_DIR,
    GUEST_AGENT_DIR,
    PROC_READ_ONLY,
    SYSTEM_TOP,
    VAR_LINKS,
    Bind,
    HostView,
    Symlink,
    image_entries,
    on_shared_paths,
    passwd_binds,
    policy_binds,
    root_entries,
)
from corral.backends.users import ROOT_CAPS
from corral.policy import Policy

__all__ = ["ROOT_CAPS"]


@dataclass(frozen=True, slots=True)
class BwrapFds:
    """File descriptor numbers bwrap inherits."""

    info: int
    userns_block: int
    seccomp: int
    block: int | None = None
    """``--block-fd``: bwrap waits on it once the box's mounts are built, before it forks
    the box's first process; the host moves bwrap into the box's cgroup meanwhile."""


@dataclass(frozen=True, slots=True)
class BwrapInputs:
    """What the bwrap command line of a box is built from."""

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
    extra_binds: tuple[Bind, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)
    """Idmapped mount points replacing ``allow_write`` and ``mounts`` host paths."""
    devpts: Path | None = None
    """Where the host mounts the box's own capped devpts in its namespace
    (:mod:`corral.backends.host.devpts`): bound over ``/dev/pts``."""
    image_root: Path | None = None
    """The image's root directory (``policy.image``), instead of the host's system."""
    image_writable: bool = False
    """``image_root`` is the box's overlay (``filesystem.root_size``): bound read-write."""
    hidden: HiddenPython | None = None
    """With ``image_root``: how the agent's interpreter runs from the host's /usr."""
    root_commands: bool = False
    """Commands run as box root (``policy.user = "root"``): the box keeps the capabilities
    :data:`ROOT_CAPS` over its own namespace (and nothing outside it)."""
    workspace_host_path: str | None = None
    """Where the workspace is on the host: a symlink there leads to the workdir, so what
    was made on the host naming that path (a venv's scripts' ``#!``) runs in the box too."""


def _parent_dirs(dest: str, made: set[str]) -> list[str]:
    """Make a mount point's missing parents listable (bwrap would make them 0700 as the
    box's root, and uid 1000 could not reach the mount). Existing directories are left as
    they are."""
    args: list[str] = []
    parent = posixpath.dirname(dest)
    chain = []
    while parent not in ("/", "") and parent not in made:
        chain.append(parent)
        parent = posixpath.dirname(parent)
    for path in reversed(chain):
        made.add(path)
        args += ["--perms", "0755", "--dir", path]
    return args


def _render(entry: Bind | Symlink) -> list[str]:
    if isinstance(entry, Symlink):
        return ["--symlink", entry.target, entry.dest]
    return ["--bind" if entry.writable else "--ro-bind", entry.source, entry.dest]


def _root_args(policy: Policy, inp: BwrapInputs, host: HostView, made: set[str]) -> list[str]:
    """The box's root is bwrap's tmpfs (so mount points like /workspace can be made), with
    the host system's entries bound read-only on it; ``--remount-ro /`` seals it at the end."""
    roots: list[Bind | Symlink]
    if inp.image_root is not None:
        args: list[str] = []
        if inp.image_writable:  # the overlay whole: new top-level entries may be made, and
            # its /etc/passwd is the image's own, which box root may change (useradd)
            roots = [Bind(str(inp.image_root), "/", writable=True)]
        else:  # the image's entries, and the box's passwd over the image's if it has one
            roots = image_entries(inp.image_root)
            roots += [
                b
                for b in passwd_binds(policy, inp.passwd_file)
                if image_has_file(inp.image_root, b.dest)
            ]
    else:
        # bwrap makes missing mount points 0700 as the box's root: /etc must be listable.
        args = [] if policy.filesystem.inherit_readable else ["--perms", "0755", "--dir", "/etc"]
        roots = [*root_entries(policy, inp.python, host), *passwd_binds(policy, inp.passwd_file)]
    for entry in roots:
        args += _parent_dirs(entry.dest, made)  # /var of /var/lib/dpkg
        args += _render(entry)
    return args


_ALIAS_TOPS_TAKEN = SYSTEM_TOP | {"proc", "dev", "run", "workspace"}


def _workspace_alias(policy: Policy, inp: BwrapInputs, binds: list[Bind]) -> str | None:
    """The workspace's host path, where a symlink to the workdir can stand in the box's
    root: not the workdir itself, nor on the system view, nor on, in or above a mount."""
    path = inp.workspace_host_path
    if path is None or inp.image_root is not None or not path.startswith("/"):
        return None
    path = posixpath.normpath(path)
    top = path.strip("/").split("/")[0]
    if path == "/" or top in _ALIAS_TOPS_TAKEN or top == policy.workdir.strip("/").split("/")[0]:
        return None
    if any(path == link or path.startswith(link + "/") for _, link in VAR_LINKS):
        return None  # /var/tmp and the like are links in the box: nothing can be made in them
    for dest in [b.dest for b in binds] + [b.dest for b in inp.extra_binds] + ["/tmp", "/home"]:
        if dest in ("/tmp", "/home") and path.startswith(dest + "/"):
            continue  # the box's own tmpfs: the link is made in it
        if path == dest or path.startswith(dest + "/") or dest.startswith(path + "/"):
            return None
    return path


def bwrap_argv(policy: Policy, inp: BwrapInputs, host: HostView | None = None) -> list[str]:
    """Translate a policy into the full bwrap command line that starts the guest agent."""
    host = host or HostView(placeholder=safepath.make_dirs)
    fs = policy.filesystem
    args = [
        "bwrap",
        "--unshare-user",
        "--userns-block-fd",
        str(inp.fds.userns_block),
        "--info-fd",
        str(inp.fds.info),
        *(["--block-fd", str(inp.fds.block)] if inp.fds.block is not None else []),
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
    if inp.root_commands:
        for cap in ROOT_CAPS:
            args += ["--cap-add", cap]
    made: set[str] = {"/etc"}
    args += _root_args(policy, inp, host, made)
    # The box's own IPC namespace's POSIX message queues, where Landlock can name them
    # (mq_open goes through the namespace's internal mount: its root is this mount's root).
    args += ["--dev", "/dev", "--mqueue", "/dev/mqueue"]
    if inp.devpts is not None:  # bwrap's own devpts has no max=: the host's capped one
        args += ["--dev-bind", str(inp.devpts), "/dev/pts"]
    args += ["--proc", "/proc"]
    # The host's /sys is bound late (just before the policy's binds, which may lie below it):
    # it brings its ~13 submounts (sysfs, the cgroup hierarchies), and bwrap re-reads the
    # whole mount table after every bind: each bind before it reads 13 lines fewer (~0.5 ms
    # of bwrap's CPU). Nothing else is mounted below /sys, so the box's tree is the same.
    sys_at = next(
        (i for i in range(len(args)) if args[i : i + 3] == ["--ro-bind", "/sys", "/sys"]), None
    )
    sys_args: list[str] = []
    if sys_at is not None:
        del args[sys_at : sys_at + 3]
        # The host's /sys comes with its cgroupfs: other boxes' ids and memory use.
        sys_args = ["--ro-bind", "/sys", "/sys"]
        sys_args += ["--perms", "0555", "--size", "4096", "--tmpfs", CGROUP_DIR]
    for path in PROC_READ_ONLY:
        args += ["--ro-bind-try", path, path]
    args += ["--size", str(fs.tmp_size), "--tmpfs", "/tmp"]
    # The box user's home is made by the agent, as that user (a tmpfs here is box root's).
    # Each capped as /tmp is, on every backend: a tmpfs is memory, and an uncapped one (half
    # the host's RAM) filled past the box's memory limit took the guest agent with it.
    size = ["--size", str(fs.tmp_size)]
    args += [*size, "--tmpfs", "/run", "--perms", "0755", *size, "--tmpfs", "/home"]
    args += ["--chmod", "1777", "/tmp"]
    # POSIX shared memory (multiprocessing's locks and pools, shm_open) wants a /dev/shm
    # anyone may write, as OCI and the microVM give it: bwrap's --dev leaves a 0755 dir.
    args += ["--size", str(fs.tmp_size), "--tmpfs", "/dev/shm", "--chmod", "1777", "/dev/shm"]
    args += ["--ro-bind", str(inp.agent_dir), GUEST_AGENT_DIR]
    interpreter: tuple[str, ...] = (inp.python,)
    if inp.image_root is not None and inp.hidden is not None:
        args += ["--ro-bind", inp.hidden.usr, HOST_PREFIX + "/usr"]
        interpreter = inp.hidden.argv
    for extra in inp.extra_binds:
        args += _render(extra)
    args += sys_args
    binds = policy_binds(policy, inp.workspace, inp.masked_file, inp.masked_dir, host, inp.sources)
    if inp.image_root is not None:  # masks of the host's own files: not in an image's root
        binds = on_shared_paths(policy, binds)
    for bind in binds:
        args += _parent_dirs(bind.dest, made)
        args += _render(bind)
    alias = _workspace_alias(policy, inp, binds)
    if alias is not None:
        args += _parent_dirs(alias, made)
        args += _render(Symlink(policy.workdir, alias))
    if not inp.image_writable:
        args += ["--remount-ro", "/"]
    args += ["--seccomp", str(inp.fds.seccomp)]
    # The agent's locale, whatever bwrap itself was started with (without LANG, so that the
    # id-dropping helper before it skips loading a locale).
    args += ["--setenv", "LANG", "C.UTF-8"]
    args += ["--chdir", "/", "--"]  # the agent needs no cwd; commands get theirs
    args += [*interpreter, "-I", "-S", f"{GUEST_AGENT_DIR}/agent.py", *inp.agent_args]
    return args


_ONE_PATH = {"--tmpfs", "--proc", "--dev", "--mqueue", "--dir", "--remount-ro"}
_TWO_PATHS = {
    "--bind",
    "--ro-bind",
    "--dev-bind",
    "--bind-try",
    "--ro-bind-try",
    "--bind-fd",
    "--ro-bind-fd",
    "--symlink",
}


def placeholders(argv: list[str], image_root: Path) -> frozenset[str]:
    """The mount destinations of ``argv`` the image at ``image_root`` lacks, relative
    (``workspace``, ``etc/resolv.conf``): on a writable root bwrap makes them in the overlay,
    and they are the box's mount points (what is written there goes to what is mounted), not
    its changes. Looked up beneath the image without following links."""
    made = set()
    for dest in _mount_dests(argv, dirs=False):
        rel = dest.strip("/")
        try:
            os.close(safepath.open_beneath(image_root, rel, os.O_PATH | os.O_NOFOLLOW))
        except OSError:
            made.add(rel)
    return frozenset(made)


_FRESH = {"--tmpfs", "--proc", "--dev"}
"""Options that mount a new filesystem: what lies below their destination is not the root's."""


def _mount_dests(argv: list[str], *, dirs: bool = True) -> list[str]:
    """The destinations bwrap resolves in the box's root (not those beneath a new
    filesystem it mounted, such as ``/dev/pts`` in its ``/dev``); ``dirs``: those of
    ``--dir`` too (directories it makes, not mount points)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    dests: list[str] = []
    fresh: list[str] = []
    for i, arg in enumerate(options):
        at = i + 1 if arg in _ONE_PATH else i + 2 if arg in _TWO_PATHS else -1
        if not 0 < at < len(options) or arg == "--symlink" or options[at] == "/":
            continue
        if arg == "--dir" and not dirs:
            continue
        dest = options[at]
        if any(dest.startswith(f.rstrip("/") + "/") for f in fresh):
            continue
        dests.append(dest)
        if arg in _FRESH:
            fresh.append(dest)
    return dests


def image_link_in_the_way(argv: list[str], image_root: Path, writable: bool) -> str | None:
    """A mount destination of ``argv`` that passes through a symlink of the image (``/tmp
    -> /etc``, ``/workspace -> /usr``), or None. bwrap resolves a destination before it
    pivots into the box's root, so such a link would send the mount, or the directories
    bwrap makes for it, to a path of the host's root instead (inside the box's private
    mount namespace, as its unprivileged owner uid: still nothing to allow).

    A read-only root is bwrap's tmpfs with the image's top-level links copied on it: only
    those matter. A writable root is the image itself: every component is looked up beneath
    it on the host without following a link."""
    links = (
        {}
        if writable
        else {e.dest.strip("/"): e for e in image_entries(image_root) if isinstance(e, Symlink)}
    )
    for dest in _mount_dests(argv):
        rel = dest.strip("/")
        if not writable:
            if rel.split("/")[0] in links:
                return dest
            continue
        try:
            fd = safepath.open_beneath(image_root, rel, os.O_PATH | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link on the way
                return dest
            continue
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):  # the destination itself
                return dest
        finally:
            os.close(fd)
    return None


def hide_options(argv: list[str]) -> tuple[list[str], bytes]:
    """Move bwrap's options (host paths, the mask list) out of its argv, which every process
    of the box reads in ``/proc/1/cmdline``: they go through ``--args FD`` instead.

    Returns the argv that stays (bwrap, ``--args``, a placeholder for the fd number, and the
    command after ``--``) and the NUL-separated options to write to that fd."""
    end = argv.index("--")
    options = argv[1:end]
    data = b"".join(os.fsencode(arg) + b"\0" for arg in options)
    return [argv[0], "--args", "", *argv[end:]], data


_BY_FD = {"--bind": "--bind-fd", "--ro-bind": "--ro-bind-fd"}


def bind_sources(argv: list[str]) -> list[str]:
    """The host paths ``--bind`` and ``--ro-bind`` options of ``argv`` mount, in order
    (bwrap's options only: nothing after ``--``)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return [options[i + 1] for i, arg in enumerate(options[:-2]) if arg in _BY_FD]


def binds(argv: list[str]) -> list[tuple[str, str]]:
    """``(host source, guest destination)`` of each ``--bind`` and ``--ro-bind`` option of
    ``argv``, in order (bwrap's options only: nothing after ``--``)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return [(options[i + 1], options[i + 2]) for i, arg in enumerate(options[:-2]) if arg in _BY_FD]


def binds_by_fd(argv: list[str], fds: Mapping[str, int]) -> list[str]:
    """``argv`` with each bind whose source is in ``fds`` made from that open descriptor
    (``--bind-fd FD DEST``): bwrap then mounts the object the host opened, and a path a box
    swapped for a symlink since (in a writable area) cannot redirect the mount."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _BY_FD and i + 2 < len(argv) and argv[i + 1] in fds:
            out += [_BY_FD[arg], str(fds[argv[i + 1]]), argv[i + 2]]
            i += 3
            continue
        if arg == "--":
            return out + argv[i:]
        out.append(arg)
        i += 1
    return out
