"""The VM monitor's jail: qemu runs the way Firecracker's jailer runs its VMM.

A guest-kernel exploit lands in qemu, so qemu holds as little as the host can take away:

- an unprivileged host uid: the one box uid 1000 maps to on the other backends
  (:mod:`corral.backends.host.idmap`: ``COMMAND_HOST_ID``, or the workspace owner where
  idmapped mounts are unavailable, never root), as uid 1000 of a user namespace mapping that
  id alone, with no capability, ``no_new_privs`` and no supplementary group (but /dev/kvm's);
- namespaces of its own: user, mount, pid (qemu is its PID 1), ipc, uts, cgroup and net
  (an empty one: the VM has no NIC, and its channels are unix sockets in its run directory);
- a root of its own (bwrap's tmpfs) holding only qemu's binary, the directories of the
  libraries it links, its firmware directories, the kernel and the initramfs, ``/dev/kvm``
  under KVM, the box's run directory (the sockets qemu connects to, its QMP socket and the
  console log), the read-only system view the guest's root is made of (:data:`VIEW`: the
  same host entries the other backends bind, never the whole host root) and the policy's
  shares (:data:`SHARES`: the workspace, ``allow_write`` paths and ``mounts``, idmapped);
- qemu's own seccomp filter (:data:`SANDBOX`): no obsolete syscalls, no set*id, no
  fork/exec, no scheduler or affinity changes;
- a host cgroup (memory and pids) for qemu and its threads.

Every path is bound from a file descriptor the host opened (``--ro-bind-fd``), so nothing is
resolved by a uid that could not reach it, nor twice. A saved VM is read from (and written
to) a file descriptor qemu inherits: qemu never opens the snapshot directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from corral.backends.layout import MERGED_USR_LINKS, PRIVATE_TOP, Bind, Symlink

RUN = "/run/vm"
"""The box's run directory inside the jail (sockets, QMP, console log)."""
VIEW = "/view"
"""The read-only system view the guest's root is made of (9p tag ``root``)."""
SHARES = "/shares"
"""The workspace and the policy's shares (9p tags ``ws``, ``m0``, ...)."""
VIEW_MOUNT_POINTS = ("proc", "sys", "dev", "tmp", "run", "home")
"""Directories the guest mounts its own filesystems on (never host content)."""
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
"""qemu's ``-sandbox``: its seccomp filter."""
QEMU_UID = 1000
"""qemu's uid (and gid) inside its user namespace: the box user's, as on the other backends."""
PIDS_MAX = 256
"""qemu's threads: vCPUs, the I/O thread pool (up to 64), RCU, migration."""
MEMORY_OVERHEAD_MB = 768
"""qemu's own memory above the guest's RAM (TCG's translation cache is the largest part)."""


@dataclass(frozen=True, slots=True)
class Runtime:
    """What qemu needs to run, bound at the same paths: its binary, the directories of the
    libraries it and its accelerator modules link (module directory included), its firmware
    search path, and the merged-/usr links."""

    files: tuple[tuple[str, str], ...]
    """``(host path, jail path)``: the binary."""
    dirs: tuple[str, ...]
    """Directories bound whole (one bind per library directory, not one per library: each
    bind costs bwrap a pass over the mount table, about 1.5 ms here)."""
    links: tuple[Symlink, ...]


def _ldd(path: str) -> list[str]:
    try:
        out = subprocess.run(
            ["ldd", path], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"(/\S+) \(0x", out)


def _firmware_dirs(qemu: str) -> list[str]:
    """qemu's firmware search path (``-L help``): the directories that exist."""
    try:
        out = subprocess.run(
            [qemu, "-L", "help"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    dirs = [os.path.realpath(line.strip()) for line in out.splitlines() if line.strip()]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


@functools.cache
def _runtime(qemu: str, _stamp: int) -> Runtime:
    libs = _ldd(qemu)
    lib_dirs = [os.path.realpath(os.path.dirname(p)) for p in libs]
    module_dirs = [d for d in (os.path.join(ld, "qemu") for ld in lib_dirs) if os.path.isdir(d)]
    for modules in dict.fromkeys(module_dirs):  # the accelerators are modules: their libraries
        for name in sorted(os.listdir(modules)):
            if name.startswith("accel-"):
                lib_dirs += [
                    os.path.realpath(os.path.dirname(p)) for p in _ldd(f"{modules}/{name}")
                ]
    wanted = list(dict.fromkeys(lib_dirs + module_dirs + _firmware_dirs(qemu)))
    dirs = [d for d in wanted if not any(d.startswith(other + "/") for other in wanted)]
    links = tuple(Symlink(os.readlink(p), p) for p in MERGED_USR_LINKS if os.path.islink(p))
    return Runtime(files=((qemu, qemu),), dirs=tuple(dirs), links=links)


def runtime(qemu: str) -> Runtime:
    """qemu's files (found once per binary: ``ldd`` and ``qemu -L help``)."""
    return _runtime(qemu, os.stat(qemu).st_mtime_ns)


def view_entries(entries: Sequence[Bind | Symlink]) -> list[Bind | Symlink]:
    """The system view: :func:`corral.backends.layout.root_entries` without what the guest
    mounts its own of (/sys: the host's would only leak the host's state)."""
    return [e for e in entries if e.dest.strip("/").split("/")[0] not in {"sys", *PRIVATE_TOP}]


@dataclass
class JailFds:
    """The file descriptors a jail's bwrap inherits (opened by the host, closed after spawn)."""

    fds: list[int] = field(default_factory=list)

    def open(self, path: str) -> int:
        """An ``O_PATH`` descriptor of ``path`` (symlinks followed: the host's own system
        paths and corral's mount points, never a box-writable path's components)."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        self.fds.append(fd)
        return fd

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


@dataclass(frozen=True, slots=True)
class Share:
    """A host directory qemu exports over 9p, bound at ``SHARES/<tag>``."""

    tag: str
    host: str
    writable: bool


def jail_argv(
    bwrap: str,
    qemu_argv: Sequence[str],
    *,
    rt: Runtime,
    fds: JailFds,
    run_dir: str,
    boot_files: Sequence[str],
    view: Sequence[Bind | Symlink],
    shares: Sequence[Share],
    info_fd: int,
    block_fd: int,
    kvm: bool,
) -> list[str]:
    """bwrap's command line for qemu (opens the descriptors it binds into ``fds``)."""
    args = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--uid",
        str(QEMU_UID),
        "--gid",
        str(QEMU_UID),
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--info-fd",
        str(info_fd),
        "--block-fd",
        str(block_fd),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    if kvm:
        args += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
    args += list(_render(rt, fds, boot_files))
    args += ["--perms", "0755", "--dir", VIEW]
    for name in VIEW_MOUNT_POINTS:
        args += ["--perms", "0755", "--dir", f"{VIEW}/{name}"]
    made: set[str] = set()
    for entry in view:
        for parent in _parents(entry.dest):  # nested entries (/var/lib/dpkg): listable parents
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", VIEW + parent]
        if isinstance(entry, Symlink):
            args += ["--symlink", entry.target, VIEW + entry.dest]
        else:
            args += ["--ro-bind-fd", str(fds.open(entry.source)), VIEW + entry.dest]
    for share in shares:
        how = "--bind-fd" if share.writable else "--ro-bind-fd"
        args += [how, str(fds.open(share.host)), f"{SHARES}/{share.tag}"]
    args += ["--bind-fd", str(fds.open(run_dir)), RUN, "--chdir", RUN, "--"]
    return args + list(qemu_argv)


def _parents(path: str) -> list[str]:
    """The directories above ``path`` (not /), outermost first."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _render(rt: Runtime, fds: JailFds, boot_files: Sequence[str]) -> Iterator[str]:
    for link in rt.links:
        yield from ("--symlink", link.target, link.dest)
    for host, jail in rt.files:
        yield from ("--ro-bind-fd", str(fds.open(host)), jail)
    for directory in rt.dirs:
        yield from ("--ro-bind-fd", str(fds.open(directory)), directory)
    for path in boot_files:
        yield from ("--ro-bind-fd", str(fds.open(path)), path)
