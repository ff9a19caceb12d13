"""corral's own initramfs for the microVM backend: busybox, a few kernel modules, the agent.

The archive has two parts, concatenated (the kernel unpacks every cpio it finds in a row):

``base``   cached under ``state_root()/microvm`` and rebuilt when an input changes (kernel
           version, busybox, the modules, the agent's files, this module's init): a static
           busybox, the modules that 9p and virtio-serial need (Debian builds them as modules)
           in load order, the guest agent, ``/dev/console`` and the generic ``/init``.
``box``    a few hundred bytes per box: ``/boot.sh``, which mounts the shares the policy asks
           for and switches to the box's root with the agent as PID 1 (see :func:`boot_script`).

``/init`` with ``corralmode=raw`` on the kernel command line prints :data:`RAW_MARKER` and
powers off before doing anything else: the benchmark's "raw boot of the same kernel and
initramfs" and the backend's KVM/machine probe.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path

from corral.backends.base import AGENT_DIR, state_root

RAW_MARKER = "corral-raw-boot-marker"
BUSYBOX = Path("/bin/busybox")
# Wanted modules; their dependencies are added from modules.dep.
MODULES = ("virtio_mmio", "virtio_pci", "virtio_console", "9pnet_virtio", "9p", "overlay")
GUEST_AGENT_DIR = "/run/corral/agent"
CONSOLE_DEV = (5, 1)

INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
if [ "$corralmode" = raw ]; then echo {RAW_MARKER}; poweroff -f; fi
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
while read -r m; do insmod "/modules/$m" || echo "corral-init: insmod $m failed"
done < /modules/order
if ! . /boot.sh; then echo "corral-init: boot.sh failed"; fi
echo "corral-init: the guest agent could not start"
poweroff -f
"""


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


# ---- cpio (newc) ---------------------------------------------------------------------------


class CpioWriter:
    """A minimal newc archive writer (what the kernel's initramfs unpacker reads)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._ino = 1

    def _entry(
        self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
    ) -> None:
        encoded = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        self._ino += 1
        header = b"070701" + b"".join(b"%08X" % f for f in fields)
        self._parts.append(header + encoded + b"\0" * (-(len(header) + len(encoded)) % 4))
        self._parts.append(data + b"\0" * (-len(data) % 4))

    def directory(self, name: str, mode: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | mode)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def chardev(self, name: str, rdev: tuple[int, int], mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=rdev)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        data = b"".join(self._parts)
        return data + b"\0" * (-len(data) % 512)


# ---- the cached base and the per-box part --------------------------------------------------


def _agent_files() -> list[Path]:
    return sorted(p for p in AGENT_DIR.glob("*.py") if p.is_file())


def _fingerprint(kernel: Kernel, modules: list[Path]) -> str:
    h = hashlib.sha256(INIT.encode())
    h.update(kernel.version.encode())
    for path in [BUSYBOX, *(kernel.modules_dir / m for m in modules), *_agent_files()]:
        st = path.stat()
        h.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def base_archive(kernel: Kernel) -> Path:
    """The cached base initramfs for ``kernel`` (built on first use or when inputs changed)."""
    if not BUSYBOX.exists():
        raise KernelNotFound(
            "the microVM initramfs needs a static busybox; `apt-get install busybox-static`"
        )
    modules = module_order(kernel.modules_dir)
    cache = state_root() / "microvm"
    target = cache / f"initramfs-{kernel.version}-{_fingerprint(kernel, modules)}.cpio"
    if target.exists():
        return target
    cpio = CpioWriter()
    for d in ("bin", "dev", "proc", "sys", "mnt", "mnt/lower", "mnt/upper", "newroot"):
        cpio.directory(d)
    cpio.chardev("dev/console", CONSOLE_DEV)
    cpio.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    cpio.file("init", INIT.encode(), 0o755)
    cpio.directory("modules")
    for rel in modules:
        cpio.file(f"modules/{rel.name}", (kernel.modules_dir / rel).read_bytes())
    cpio.file("modules/order", "".join(f"{m.name}\n" for m in modules).encode())
    cpio.directory("agent")
    for path in _agent_files():
        cpio.file(f"agent/{path.name}", path.read_bytes())
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.glob(f"initramfs-{kernel.version}-*.cpio"):
        old.unlink(missing_ok=True)  # superseded by this build
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cpio.finish())
    tmp.replace(target)
    return target


def box_archive(base: Path, boot_sh: str, dest: Path, seccomp_filter: bytes = b"") -> Path:
    """``base`` followed by a small archive holding the box's ``/boot.sh`` (and the seccomp
    filter its agent installs, as ``/agent/seccomp.bpf``), written to ``dest``."""
    extra = CpioWriter()
    extra.file("boot.sh", boot_sh.encode(), 0o755)
    if seccomp_filter:
        extra.file("agent/seccomp.bpf", seccomp_filter, 0o444)
    dest.write_bytes(base.read_bytes() + extra.finish())
    return dest


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
    python: str
    agent_config: str
    own_workdir: str | None = None
    """chown this share's root to uid:gid (the workspace of a root-owned host directory,
    shared with ``mapped-xattr`` so the ownership lives in an xattr, not on the host)."""
    deny_read: tuple[str, ...] = ()
    deny_write: tuple[str, ...] = ()
    msize: int = 512 * 1024


def boot_script(plan: BootPlan) -> str:
    """``/boot.sh``: overlay root over the host's root share, shares, tmpfses, the agent."""
    q = shlex.quote
    opts = f"trans=virtio,version=9p2000.L,msize={plan.msize}"
    lines = [
        "set -e",
        f"mount -t 9p -o {opts},ro,cache=loose root /mnt/lower",
        "mount -t tmpfs -o mode=0755 upper /mnt/upper",
        "mkdir /mnt/upper/u /mnt/upper/w",
        ": > /mnt/upper/masked",
        "chmod 000 /mnt/upper/masked",
        # nosuid, nodev: a setuid binary or a device node of the host tree grants nothing
        # (no_new_privs already makes setuid inert; this holds without it too).
        "mount -t overlay -o lowerdir=/mnt/lower,upperdir=/mnt/upper/u,workdir=/mnt/upper/w"
        ",nosuid,nodev overlay /newroot",
        "R=/newroot",
        "mount -t proc proc $R/proc",
        "mount -t sysfs sys $R/sys",
        "mount -t devtmpfs dev $R/dev",
        "mkdir -p $R/dev/pts $R/dev/shm",
        "mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts $R/dev/pts",
        "mount -t tmpfs -o mode=1777 shm $R/dev/shm",
        f"mount -t tmpfs -o mode=1777,size={plan.tmp_size} tmp $R/tmp",
        "mount -t tmpfs -o mode=0755 run $R/run",
        f"mkdir -p $R{GUEST_AGENT_DIR}",
        f"cp /agent/* $R{GUEST_AGENT_DIR}/",
        "mount -t tmpfs -o mode=0755 home $R/home",
        "mkdir $R/home/user",
        f"chown {plan.uid}:{plan.gid} $R/home/user",
    ]
    for share in plan.shares:
        mode = "ro" if share.read_only else "rw"
        target = q("/newroot" + share.guest)
        lines.append(f"mkdir -p {target}")
        lines.append(f"mount -t 9p -o {opts},{mode},cache={share.cache} {share.tag} {target}")
    if plan.own_workdir is not None:
        lines.append(f"chown {plan.uid}:{plan.gid} {q('/newroot' + plan.own_workdir)}")
    for path in plan.deny_write:
        target = q("/newroot" + path)
        lines.append(
            f"if [ -e {target} ]; then mount --bind {target} {target};"
            f" mount -o remount,bind,ro {target}; fi"
        )
    for path in plan.deny_read:
        target = q("/newroot" + path)
        lines.append(
            f"if [ -d {target} ]; then mount -t tmpfs -o mode=000,size=4k deny {target};"
            f" elif [ -e {target} ]; then mount --bind /mnt/upper/masked {target}; fi"
        )
    lines += [
        f"hostname {q(plan.hostname)}",
        "ip link set lo up 2>/dev/null || true",
        "for p in /sys/class/virtio-ports/*; do"
        ' [ "$(cat $p/name 2>/dev/null)" = corral ] && ln -sf /dev/${p##*/} $R/dev/corral;'
        " done",
        "set +e",
        f"exec switch_root /newroot {q(plan.python)} -I -S {GUEST_AGENT_DIR}/agent.py"
        f" {q(plan.agent_config)}",
    ]
    return "\n".join(lines) + "\n"
