"""corral's own initramfs for the microVM backend: busybox, a few kernel modules, the agent,
and the Python that runs it.

One archive serves every box (cached under ``cache_root()/microvm``, rebuilt when an input
changes: kernel version, busybox, the modules, the agent's files, the interpreter): a static
busybox, the modules 9p, virtio-serial and overlayfs need (Debian builds them as modules) in
load order, the agent precompiled, the host's interpreter with its shared libraries and the
standard modules the agent imports (:mod:`vmpython`), ``/dev/console`` and ``/init``.

``/init`` loads the modules and execs the agent (``--vm-init``), which writes
:data:`SNAPSHOT_MARKER` on the channel and waits for the box's payload
(:func:`boot_payload`: the script of :func:`boot_script`, its config and the host's time).
Nothing box-specific is in the archive or in the VM before that line, so one saved VM serves
every box of the same shape. With ``corralmode=raw`` on the kernel command line, ``/init``
prints :data:`RAW_MARKER` and powers off before doing anything: the benchmark's "raw boot of
the same kernel and initramfs" and the backend's KVM/machine probe.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import lzma
import os
import shlex
import stat
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from corral.agent import protocol
from corral.backends.base import AGENT_DIR
from corral.backends.host.state import cache_root
from corral.backends.microvm import vmpython, vmsnap
from corral.policy import CPU_PERIOD_US

RAW_MARKER = "corral-raw-boot-marker"
SNAPSHOT_MARKER = protocol.VM_SNAPSHOT_MARKER.decode().strip()
"""Written by the agent on the channel once the kernel is up, its modules loaded and the
agent's imports done, before anything box-specific: the host may save the VM there (see
:mod:`corral.backends.microvm.vmsnap`), then sends :func:`boot_payload`."""
BUSYBOX = Path("/bin/busybox")
# Wanted modules; their dependencies are added from modules.dep.
MODULES = ("virtio_mmio", "virtio_pci", "virtio_console", "9pnet_virtio", "9p", "overlay")
GUEST_AGENT_DIR = "/run/corral/agent"
GUEST_CGROUP = "/sys/fs/cgroup/box"
CONSOLE_DEV = (5, 1)
DEV_NODES = (
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
)
"""The box's character devices (``/dev`` of the VM's box is a tmpfs holding these alone)."""

_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
if [ "$corralmode" = raw ]; then echo {marker}; poweroff -f; fi
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
while read -r m; do insmod "/modules/$m" || echo "corral-init: insmod $m failed"
done < /modules/order
for p in /sys/class/virtio-ports/*; do
  [ "$(cat "$p/name" 2>/dev/null)" = corral ] && PORT=/dev/${{p##*/}}
done
if [ -z "$PORT" ]; then echo "corral-init: no corral port"; poweroff -f; fi
exec {python} -I -S /agent/agent.py --vm-init "$PORT"
echo "corral-init: the guest agent could not start"
poweroff -f
"""


def init_script(python: str) -> str:
    """``/init``: busybox, the modules, then the agent (from the initramfs) as PID 1, which
    signals the snapshot point and waits for the box's script (see :func:`boot_payload`)."""
    return _INIT.format(marker=RAW_MARKER, python=shlex.quote(python))


class KernelNotFound(Exception):
    """No usable kernel (with 9p modules) on this host; the message names the fix."""


@dataclass(frozen=True, slots=True)
class Kernel:
    image: Path
    version: str
    modules_dir: Path


def find_kernel(explicit: Path | None = None) -> Kernel:
    """``explicit``, or the newest ``/boot/vmlinuz-*`` whose modules include 9p."""
    candidates = [explicit] if explicit is not None else sorted(Path("/boot").glob("vmlinuz-*"))
    problems: list[str] = []
    for image in reversed(candidates):
        version = image.name.removeprefix("vmlinuz-")
        modules_dir = Path("/lib/modules") / version
        if not os.access(image, os.R_OK):
            problems.append(f"{image} is not readable")
        elif not (modules_dir / "kernel/fs/9p/9p.ko").exists():
            problems.append(f"{image}: no 9p module in {modules_dir}")
        else:
            return Kernel(image, version, modules_dir)
    detail = "; ".join(problems) or "no /boot/vmlinuz-* found"
    raise KernelNotFound(
        f"no kernel with 9p support for the microVM ({detail}); install one with "
        "`apt-get install linux-image-amd64` (the cloud kernel lacks 9p) or set vm.kernel"
    )


def module_order(modules_dir: Path, wanted: tuple[str, ...] = MODULES) -> list[Path]:
    """Module files (relative to ``modules_dir``) with every dependency before its user."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko")[0].replace("-", "_")] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in by_name:  # built into this kernel when absent from modules.dep
            visit(by_name[name])
    return [Path(p) for p in order]


def boot_image(kernel: Kernel) -> Path:
    """The kernel as qemu boots it fastest: the uncompressed ELF inside the bzImage, which
    qemu enters through its PVH entry point, so the guest skips decompressing itself (about
    4 s of a 6 s boot under software emulation). Extracted once and cached; the bzImage
    itself when the kernel has no PVH entry or its payload is not xz or gzip."""
    config = Path("/boot") / f"config-{kernel.version}"
    with contextlib.suppress(OSError):
        if "CONFIG_PVH=y" not in config.read_text():
            return kernel.image
    st = kernel.image.stat()
    cache = cache_root() / "microvm"
    target = cache / f"vmlinux-{kernel.version}-{st.st_size:x}{st.st_mtime_ns:x}"
    if target.exists():
        return target
    data = kernel.image.read_bytes()
    elf: bytes | None = None
    for magic, decompress in ((b"\xfd7zXZ\x00", _unxz), (b"\x1f\x8b\x08", _gunzip)):
        at = data.find(magic)
        if at >= 0:
            with contextlib.suppress(lzma.LZMAError, OSError, EOFError, zlib.error):
                elf = decompress(data[at:])
            break
    if elf is None or not elf.startswith(b"\x7fELF"):
        return kernel.image
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob(f"vmlinux-{kernel.version}-*"):
        old.unlink(missing_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(elf)
    tmp.replace(target)
    return target


KEEP_ARCHIVES = 3
"""Older initramfs archives kept beside a new one: another corral (another version or
checkout of it) may be about to boot from one, and qemu opens it only when it starts."""


def _prune_archives(cache: Path, pattern: str, keep: int = KEEP_ARCHIVES) -> None:
    """Remove all but the ``keep`` most recently used archives matching ``pattern``."""
    for old in sorted(cache.glob(pattern), key=vmsnap.last_used, reverse=True)[keep:]:
        old.unlink(missing_ok=True)


def _unxz(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _gunzip(data: bytes) -> bytes:
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)


# ---- cpio (newc) ---------------------------------------------------------------------------


class CpioWriter:
    """A minimal newc archive writer (what the kernel's initramfs unpacker reads)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._ino = 1

    def _entry(
        self,
        name: str,
        mode: int,
        data: bytes = b"",
        rdev: tuple[int, int] = (0, 0),
        mtime: int = 0,
    ) -> None:
        encoded = name.encode() + b"\0"
        size = len(data)
        fields = (self._ino, mode, 0, 0, 1, mtime, size, 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self._ino += 1
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self._parts.append(header + encoded + b"\0" * (-(len(header) + len(encoded)) % 4))
        self._parts.append(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str, mode: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | mode)

    def file(self, name: str, data: bytes, mode: int = 0o644, mtime: int = 0) -> None:
        self._entry(name, stat.S_IFREG | mode, data, mtime=mtime)

    def host_file(self, path: Path, made: set[str]) -> None:
        """``path`` at the same place, with its mode and mtime (a pyc beside its source
        stays valid), after every parent directory not yet in ``made``."""
        name = str(path).lstrip("/")
        self.parents(name, made)
        st = path.stat()
        self.file(name, path.read_bytes(), stat.S_IMODE(st.st_mode), int(st.st_mtime))

    def parents(self, name: str, made: set[str]) -> None:
        parts = name.split("/")[:-1]
        for n in range(1, len(parts) + 1):
            d = "/".join(parts[:n])
            if d not in made:
                made.add(d)
                self.directory(d)

    def chardev(self, name: str, rdev: tuple[int, int], mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=rdev)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        data = b"".join(self._parts)
        return data + b"\0" * (-len(data) % 512)


# ---- the cached base and the per-box part --------------------------------------------------


def _agent_files() -> list[Path]:
    return sorted(p for p in AGENT_DIR.glob("*.py") if p.is_file())


def _fingerprint(kernel: Kernel, modules: list[Path], python: str) -> str:
    h = hashlib.sha256(init_script(python).encode())
    h.update(kernel.version.encode())
    inputs = [BUSYBOX, *(kernel.modules_dir / m for m in modules), *_agent_files()]
    for path in [*inputs, Path(python)]:
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


_COMPILE = """
import importlib.util, os, py_compile, sys
for src in sys.argv[3:]:
    name = os.path.basename(importlib.util.cache_from_source(src))
    py_compile.compile(
        src, cfile=os.path.join(sys.argv[1], name), dfile=sys.argv[2] + "/" + os.path.basename(src),
        doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
"""


def compiled_agent(python: str, sources: list[Path]) -> dict[str, bytes]:
    """The agent's modules compiled by the guest's own python, as ``{pyc name: bytes}``.

    Unchecked-hash pycs: the guest never compiles the agent at boot (about 0.2 s under TCG)
    and never checks them against a source mtime (the cpio has none). Empty when the
    interpreter cannot compile them (the guest then compiles at boot, as before)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [python, "-I", "-S", "-c", _COMPILE, tmp, GUEST_AGENT_DIR, *map(str, sources)]
        try:
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return {}
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).glob("*.pyc"))}


def check_busybox() -> None:
    """KernelNotFound (naming the fix) when the static busybox the initramfs needs is missing."""
    if not BUSYBOX.exists():
        raise KernelNotFound(
            "the microVM initramfs needs a static busybox; `apt-get install busybox-static`"
        )


def base_archive(kernel: Kernel, python: str) -> Path:
    """The cached base initramfs for ``kernel`` (built on first use or when inputs changed),
    with ``python`` (the host's interpreter, the agent's in the guest) and the agent.
    Blocking (it may run the interpreter and compress files): call it in a thread."""
    check_busybox()
    modules = module_order(kernel.modules_dir)
    cache = cache_root() / "microvm"
    fingerprint = _fingerprint(kernel, modules, python)
    target = cache / f"initramfs-{kernel.version}-{fingerprint}.cpio"
    if target.exists():
        with contextlib.suppress(OSError):
            os.utime(target)  # most recently used: the last a newer build would remove
        return target
    try:
        runtime, runtime_dirs = vmpython.runtime_files(python)
    except vmpython.RuntimeNotPackable as exc:
        raise KernelNotFound(f"the microVM initramfs needs the agent's python: {exc}") from None
    cpio = CpioWriter()
    made = {"bin", "dev", "proc", "sys", "mnt", "mnt/lower", "mnt/upper", "newroot"}
    for d in sorted(made):
        cpio.directory(d)
    cpio.chardev("dev/console", CONSOLE_DEV)
    cpio.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    cpio.file("init", init_script(python).encode(), 0o755)
    for path in runtime:
        cpio.host_file(path, made)
    for directory in runtime_dirs:
        cpio.parents(str(directory).lstrip("/") + "/x", made)
    cpio.directory("modules")
    for rel in modules:
        cpio.file(f"modules/{rel.name}", (kernel.modules_dir / rel).read_bytes())
    cpio.file("modules/order", "".join(f"{m.name}\n" for m in modules).encode())
    cpio.directory("agent")
    for path in _agent_files():
        cpio.file(f"agent/{path.name}", path.read_bytes())
    compiled = compiled_agent(python, _agent_files())
    if compiled:
        cpio.directory("agent/__pycache__")
    for name, data in compiled.items():
        cpio.file(f"agent/__pycache__/{name}", data)
    cache.mkdir(parents=True, exist_ok=True)
    _prune_archives(cache, f"initramfs-{kernel.version}-*.cpio")
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cpio.finish())
    tmp.replace(target)
    return target


# ---- the per-box boot script (a pure function of its inputs) -------------------------------


@dataclass(frozen=True, slots=True)
class Share:
    """A 9p share: ``tag`` (as qemu names it) mounted at ``guest`` inside the box."""

    tag: str
    guest: str
    read_only: bool
    cache: str = "mmap"


@dataclass(frozen=True, slots=True)
class BootPlan:
    shares: tuple[Share, ...]
    """Mounted in order, after the root (tag ``root``)."""
    hostname: str
    uid: int
    gid: int
    tmp_size: int
    agent_config: str
    own_workdir: str | None = None
    """chown this share's root to uid:gid (the workspace of a root-owned host directory,
    shared with ``mapped-xattr`` so the ownership lives in an xattr, not on the host)."""
    deny_read: tuple[str, ...] = ()
    deny_write: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    """The shares a box can write (guest paths): every mask inside one is checked in the
    guest once all are mounted (:func:`mask_checks`)."""
    msize: int = 512 * 1024
    seccomp: bytes = b""
    """The compiled filter the agent installs on itself (written to ``seccomp.bpf``)."""
    minimal_root: tuple[tuple[str, str], ...] | None = None
    """``inherit_readable = false``: the root is a tmpfs holding only these ``(host path or
    link target, box path)`` entries (read-only binds of the host's root share; an entry
    whose first item starts with ``->`` is a symlink), and :attr:`passwd` as /etc/passwd."""
    passwd: str = ""
    group: str = ""
    root_dirs: tuple[str, ...] = ()
    """Directories of the system view made by the jail (qemu's uid): chowned to root."""
    """The box's /etc/group (and :attr:`passwd` its /etc/passwd), on every root."""
    root_size: int | None = None
    """A box on an image (the ``root`` share is the image's entries): the cap of the tmpfs
    above it (``filesystem.root_size``)."""
    read_only_root: bool = False
    """A box on an image with ``root_size = null``: the root is remounted read-only once
    the box's mounts are made."""
    make_dirs: tuple[str, ...] = ()
    """Directories to make in the root when missing (an image's ``WorkingDir``), in the
    guest (its links resolve in the VM)."""
    memory_max: int | None = None
    pids_max: int | None = None
    cpu_max_us: int | None = None
    """Microseconds of CPU per 100 ms period (``cpu.max``)."""
    """The box's limits, enforced by the guest kernel's cgroup (v2) :data:`GUEST_CGROUP`,
    which holds the agent and so every command (as the box's cgroup does on the host)."""


def boot_script(plan: BootPlan) -> str:
    """The box's mounts, under ``/newroot``: an overlay over the host's root share, the
    shares, private tmpfses, the agent's files (the agent moves into ``/newroot`` after)."""
    q = shlex.quote
    opts = f"trans=virtio,version=9p2000.L,msize={plan.msize}"
    lines = [
        "set -e",
        f"mount -t 9p -o {opts},ro,cache=loose root /mnt/lower",
        "mount -t tmpfs -o mode=0755"
        + ("" if plan.root_size is None else f",size={plan.root_size}")
        + " upper /mnt/upper",
        "mkdir /mnt/upper/u /mnt/upper/w",
        ": > /mnt/upper/masked",
        "chmod 000 /mnt/upper/masked",
        # nosuid, nodev: a setuid binary or a device node of the host tree grants nothing
        # (no_new_privs already makes setuid inert; this holds without it too).
        "R=/newroot",
    ]
    if plan.minimal_root is None:
        lines.append(
            "mount -t overlay -o lowerdir=/mnt/lower,upperdir=/mnt/upper/u,workdir=/mnt/upper/w"
            ",nosuid,nodev overlay /newroot"
        )
        # The overlay copies them up: root's in the guest, as bwrap's --dir makes them.
        lines += [f"chown 0:0 $R{q(d)}" for d in plan.root_dirs]
    else:
        lines += _minimal_root(plan.minimal_root)
    # The box's own accounts, on every root: the overlay's upper layer holds them.
    lines.append("mkdir -p $R/etc")  # an image may have none
    lines += [f"mkdir -p $R{q(d)}" for d in plan.make_dirs]
    lines.append(f"printf %s {q(plan.passwd)} > $R/etc/passwd")
    lines.append(f"printf %s {q(plan.group)} > $R/etc/group")
    lines += [
        "mount -t proc proc $R/proc",
        "mount -t sysfs sys $R/sys",
        # A minimal /dev, as bwrap's: no disk, /dev/mem, /dev/kmsg or port of the VM's own.
        "mount -t tmpfs -o mode=0755,size=64k,nosuid,noexec dev $R/dev",
        *(f"mknod -m 666 $R/dev/{name} c {major} {minor}" for name, major, minor in DEV_NODES),
        "mkdir -p $R/dev/pts $R/dev/shm $R/dev/mqueue",
        "mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts $R/dev/pts",
        "ln -s pts/ptmx $R/dev/ptmx",
        "ln -s /proc/self/fd $R/dev/fd",
        "ln -s /proc/self/fd/0 $R/dev/stdin",
        "ln -s /proc/self/fd/1 $R/dev/stdout",
        "ln -s /proc/self/fd/2 $R/dev/stderr",
        f"mount -t tmpfs -o mode=1777,size={plan.tmp_size},nosuid,nodev shm $R/dev/shm",
        "mount -t mqueue -o nosuid,nodev,noexec mqueue $R/dev/mqueue",
        f"mount -t tmpfs -o mode=1777,size={plan.tmp_size} tmp $R/tmp",
        f"mount -t tmpfs -o mode=0755,size={plan.tmp_size},nosuid,nodev run $R/run",
        f"mkdir -p $R{GUEST_AGENT_DIR}",
        f"cp -a /agent/. $R{GUEST_AGENT_DIR}/",
    ]
    if plan.seccomp:
        encoded = base64.encodebytes(plan.seccomp).decode()
        target = f"$R{GUEST_AGENT_DIR}/seccomp.bpf"
        lines.append(f"base64 -d > {target} <<'CORRAL_EOF'\n{encoded}CORRAL_EOF")
    lines += [
        f"mount -t tmpfs -o mode=0755,size={plan.tmp_size},nosuid,nodev home $R/home",
        "mkdir $R/home/user",
        f"chown {plan.uid}:{plan.gid} $R/home/user",
    ]
    for share in plan.shares:
        mode = "ro" if share.read_only else "rw"
        target = q("/newroot" + share.guest)
        lines.append(f"mkdir -p {target}")
        # nosuid, nodev: a setuid-root file left in a share grants nothing here either.
        lines.append(
            f"mount -t 9p -o {opts},{mode},nosuid,nodev,cache={share.cache} {share.tag} {target}"
        )
    if plan.own_workdir is not None:
        lines.append(f"chown {plan.uid}:{plan.gid} {q('/newroot' + plan.own_workdir)}")
        # The host owner's files show as root here (9p cannot idmap): git must still trust
        # the workspace, as it does on the other backends (the VM's own /etc, in memory).
        safe = f"[safe]\n\tdirectory = {plan.own_workdir}\n"
        lines.append(f"printf %s {q(safe)} >> $R/etc/gitconfig")
    for path in plan.deny_write:
        target = q("/newroot" + path)
        lines.append(
            f"if [ -e {target} ]; then mount --bind {target} {target};"
            f" mount -o remount,bind,ro,nosuid,nodev {target}; fi"
        )
    for path in plan.deny_read:
        target = q("/newroot" + path)
        lines.append(
            f"if [ -d {target} ]; then mount -t tmpfs -o mode=000,size=4k deny {target};"
            f" elif [ -e {target} ]; then mount --bind /mnt/upper/masked {target}; fi"
        )
    if plan.read_only_root:
        lines.append("mount -o remount,ro $R")
    cgroup = f"$R{GUEST_CGROUP}"
    lines += [
        "mount -t cgroup2 cgroup2 $R/sys/fs/cgroup",
        "echo '+memory +pids +cpu' > $R/sys/fs/cgroup/cgroup.subtree_control",
        f"mkdir {cgroup}",
    ]
    if plan.memory_max is not None:
        lines += [f"echo {plan.memory_max} > {cgroup}/memory.max"]
    if plan.pids_max is not None:
        lines += [f"echo {plan.pids_max} > {cgroup}/pids.max"]
    if plan.cpu_max_us is not None:  # as planned: backends.limits refuses what the kernel would
        lines += [f"echo '{plan.cpu_max_us} {CPU_PERIOD_US}' > {cgroup}/cpu.max"]
    lines += [
        f"echo 1 > {cgroup}/cgroup.procs",  # the agent, PID 1: every command is born in it
        f"hostname {q(plan.hostname)}",
        "ip link set lo up 2>/dev/null || true",
        # The channel and the network link (modes allowlist and ports): the agent's alone.
        "for p in /sys/class/virtio-ports/*; do n=$(cat $p/name 2>/dev/null); case $n in"
        " corral|corral-net) mknod -m 600 $R/dev/$n c $(tr : ' ' < $p/dev);; esac;"
        " done",
    ]
    return "\n".join(lines) + "\n"


def _minimal_root(entries: tuple[tuple[str, str], ...]) -> list[str]:
    """A tmpfs root with read-only binds of a few host paths (``inherit_readable = false``)."""
    q = shlex.quote
    lines = [
        "mount -t tmpfs -o mode=0755,nosuid,nodev root /newroot",
        "mkdir -p $R/proc $R/sys $R/dev $R/tmp $R/run $R/home $R/etc",
    ]
    for source, dest in entries:
        target = "$R" + q(dest)
        if source.startswith("->"):
            lines.append(f"ln -s {q(source[2:])} {target}")
            continue
        lower = "/mnt/lower" + q(source)
        lines += [
            f"if [ -d {lower} ]; then mkdir -p {target};"
            f" else mkdir -p $(dirname {target}) && touch {target}; fi",
            f"mount --bind {lower} {target}",
            f"mount -o remount,bind,ro,nosuid,nodev {target}",
        ]
    return lines


def mask_checks(plan: BootPlan) -> dict[str, list[str]]:
    """The masks the guest checks once its mounts are made (``hidden``: ``deny_read``,
    ``read_only``: ``deny_write``): those inside a share a box can write, where a box
    running on the same workspace could swap a link into the path while this VM mounts
    there (the guest resolves the path over 9p and would mount on the link's target). One
    covered by another mask is not visible to check, nor needs to be."""

    def inside(path: str, roots: tuple[str, ...] | list[str], strict: bool) -> bool:
        return any(
            (path == r and not strict) or path.startswith(r.rstrip("/") + "/") for r in roots
        )

    hidden = [d for d in plan.deny_read if inside(d, plan.checked, False)]
    return {
        "hidden": [d for d in hidden if not inside(d, hidden, True)],
        "read_only": [
            d
            for d in plan.deny_write
            if inside(d, plan.checked, False) and not inside(d, plan.deny_read, False)
        ],
    }


def boot_payload(plan: BootPlan, clock: float) -> bytes:
    """What the host sends at the snapshot point: ``<size>\\n`` and a JSON object with the
    box's script (its mounts, run by the agent with ``sh -e``), the agent's config, where the
    agent's files are inside the box, and the host's time (``clock``) to set the guest's."""
    body = json.dumps(
        {
            "script": boot_script(plan),
            "config": json.loads(plan.agent_config),
            "agent_dir": GUEST_AGENT_DIR,
            "clock": clock,
            "checks": mask_checks(plan),
        }
    ).encode()
    return b"%d\n" % len(body) + body
