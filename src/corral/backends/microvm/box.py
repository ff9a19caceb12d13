"""The microVM backend: the same guest agent, as PID 1 of a qemu VM.

Start-up sequence::

    1. find the kernel (newest /boot/vmlinuz-* with 9p modules), its extracted ELF (qemu
       enters it directly: no in-guest decompression) and corral's cached initramfs
       (busybox, modules, the agent and the host's python3 to run it: see initramfs.py)
    2. probe, once per host (cached on disk), which accelerator and machine boot here:
       KVM is tried, never assumed (a /dev/kvm that cannot run a stock kernel is common in
       nested setups); ``microvm`` first under KVM, ``q35`` first under TCG (see MACHINES)
    3. listen on a unix socket in the box's run directory; qemu connects to it as the
       client end of the virtio-serial port named ``corral``: the accepted socket is the
       channel. There is no NIC: a second port, ``corral-net``, carries the connections of
       network modes ``allowlist`` and ``ports`` to the host's proxy and relays, and the
       agent's dial-backs for published ports (:mod:`corral.net.vmlink`,
       :mod:`corral.net.publish`); every VM has it, so the device set (a saved VM's shape)
       does not depend on the network mode
    4. start qemu in its jail (:mod:`jail`: an unprivileged uid, namespaces, a root of its
       own, its ``-sandbox`` seccomp filter, a host cgroup) and restore the saved VM of this
       shape (``-incoming``), or boot: the agent, PID 1 from the initramfs, writes the
       snapshot-point line when its imports are done; a booting VM is saved there for the
       next boxes (:mod:`vmsnap`)
    5. send the box's payload (mounts script, agent config, host time): the agent mounts
       the system view (9p, read-only: the host entries the other backends bind, as the
       jailed qemu can read them) under a tmpfs overlay, the workspace and the policy's
       mounts (9p, idmapped on the host as on the other backends), private /tmp /run /home,
       a minimal /dev, a cgroup holding the limits, and moves into that root; its ``ready``
       frame ends the start

A box's state directory records ``"backend": "microvm"`` and qemu's pid; boxes whose owner
died are killed and removed, with their cgroups and idmapped mounts, by the first start of a
process (in a thread). The initramfs is
built (or found in the cache) at the first start too, in a thread: constructing a backend
only checks that the pieces exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import re
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from corral.agent import protocol
from corral.backends.base import (
    BackendBase,
    BoxBase,
    BoxSpec,
    BoxStats,
    agent_config,
    kill_if_named,
    refuse_image,
    sweep_boxes,
)
from corral.backends.host import (
    cgroups,
    dropids,
    idmap,
    maskfollow,
    mounts,
    safepath,
    seccomp,
    staging,
)
from corral.backends.host.child import HostChild, spawn
from corral.backends.host.python import find_python
from corral.backends.host.state import BOX_PREFIX, cache_root, state_root, write_owner
from corral.backends.host.threads import blocking
from corral.backends.layout import (
    SYSTEM_PATH,
    Bind,
    HostView,
    Symlink,
    expand,
    image_entries,
    policy_binds,
    root_entries,
)
from corral.backends.limits import Capabilities, LimitPlan, plan_limits
from corral.backends.microvm import initramfs, jail, vmsnap
from corral.backends.users import BOX_UID, group_text, passwd_text
from corral.errors import BackendError, BackendUnavailable, PolicyError
from corral.net import vmlink
from corral.policy import DEFAULT_WORKDIR, Policy, vm_memory_mb

T = TypeVar("T")
QEMU = "qemu-system-x86_64"
CHANNEL_SOCKET = "chan.sock"
NET_SOCKET = "net.sock"
"""Beside the channel's socket: qemu connects the ``corral-net`` port to it (every VM)."""
RUN_DIR = "vm"
"""The box's run directory, in its state directory: owned by qemu's uid, bound into the jail
(the sockets qemu connects to, its QMP socket, the console log)."""
CONNECT_TIMEOUT = 10.0
"""qemu connects to the channel socket while it sets up devices, before the guest runs."""
SHUTDOWN_GRACE = 3.0
"""After the agent's ``shutdown`` the guest powers off by itself; then qemu is killed."""
PROBE_TIMEOUT = {"kvm": 5.0, "tcg": 30.0}
BOOT_TIMEOUT = {"kvm": 15.0, "tcg": 90.0}
"""Boot to the agent's first frame (software emulation on a busy host takes many seconds)."""
RESTORE_TIMEOUT = {"kvm": 10.0, "tcg": 30.0}
"""Restore to the agent's first frame; past it the saved VM is discarded and the box boots."""
STALL_TIMEOUT = {"kvm": 10.0, "tcg": 45.0}
"""Boot to the agent's snapshot-point line. Under TCG a loaded host occasionally leaves a
kernel hung before its first message (a few seconds is normal): it is killed and booted again."""
# Machine types to try, in order. Under TCG, Debian's kernel on ``microvm`` (no PIT/HPET
# reference) intermittently fails to calibrate the TSC and hangs before init: q35 first.
MACHINES = {"kvm": ("microvm", "q35"), "tcg": ("q35", "microvm")}
# Quiet, no device probing the box never uses; panic (the agent, PID 1, exiting) powers off.
KERNEL_ARGS = (
    "console=ttyS0 quiet loglevel=1 panic=-1 reboot=t 8250.nr_uarts=1 i8042.noaux i8042.nomux"
    " i8042.nopnp i8042.dumbkbd tsc=reliable no_timer_check cryptomgr.notests"
    " random.trust_cpu=on"
)


def _ram_problem(policy: Policy) -> str | None:
    """Why qemu could not get the VM's RAM here (one allocation larger than the host's memory
    and swap, which the kernel's overcommit check refuses), naming the field; or None."""
    total = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return None
    ram = vm_memory_mb(policy) << 20
    if total == 0 or ram <= total:
        return None
    field = "vm.memory_mb" if policy.vm.memory_mb is not None else "limits.memory_bytes"
    return (
        f"{field}: the microVM would need {ram >> 20} MiB of RAM, more than this host has "
        f"({total >> 20} MiB with swap); lower it"
    )


@dataclass(frozen=True, slots=True)
class Boot:
    """How VMs boot on this host: accelerator and machine type (from the probe)."""

    accel: str
    machine: str
    image: Path
    """The kernel file qemu loads: the extracted ELF (PVH entry) or the bzImage."""


MICROVM_NO_LANDLOCK = "not applied in a microVM: the guest's own kernel and the VM are the boundary"


def qemu_argv(
    qemu: str,
    boot: Boot,
    *,
    initrd: Path,
    cpus: int,
    memory_mb: int,
    extra_cmdline: str = "",
    serial: str = "stdio",
) -> list[str]:
    """The machine without any device but the serial console (pure; see :func:`box_devices`)."""
    machine = boot.machine  # microvm's rtc=off / x-option-roms=off slowed or broke TCG boots
    argv = [qemu, "-nodefaults", "-no-user-config", "-nographic", "-monitor", "none"]
    argv += ["-M", machine, "-accel", boot.accel, "-cpu", "host" if boot.accel == "kvm" else "max"]
    argv += ["-smp", str(cpus), "-m", str(memory_mb), "-no-reboot", "-serial", serial]
    argv += ["-kernel", str(boot.image), "-initrd", str(initrd)]
    argv += ["-append", f"{KERNEL_ARGS} {extra_cmdline}".strip()]
    return argv


@dataclass(frozen=True, slots=True)
class HostShare:
    """A 9p export: ``host`` is its path inside qemu's jail (:data:`jail.VIEW`, or below
    :data:`jail.SHARES`)."""

    tag: str
    host: str
    read_only: bool


def box_devices(boot: Boot, shares: list[HostShare]) -> list[str]:
    """The virtio-serial ports (the channel; the network link) on sockets in the jail's run
    directory, and the 9p shares (pure)."""
    bus = "device" if boot.machine == "microvm" else "pci"
    argv = ["-chardev", f"socket,id=corral,path={jail.RUN}/{CHANNEL_SOCKET}"]
    argv += ["-chardev", f"socket,id=corralnet,path={jail.RUN}/{NET_SOCKET}"]
    argv += [
        "-device",
        f"virtio-serial-{bus}",
        "-device",
        "virtserialport,chardev=corral,name=corral",
        "-device",
        "virtserialport,chardev=corralnet,name=corral-net",
    ]
    # A generation id that changes when a saved VM is restored: the guest kernel reseeds its
    # random generator on the change, so restored VMs do not share the snapshot's randomness.
    argv += ["-device", "vmgenid,guid=auto"]
    for share in shares:
        ro = ",readonly=on" if share.read_only else ""
        # The system view spans several filesystems: keep their inode numbers apart.
        ro += ",multidevs=remap" if share.tag == "root" else ""
        path = share.host.replace(",", ",,")
        # qemu runs as the box user's host uid: it creates files as that uid (the workspace
        # owner on disk, through the idmapped mount) and cannot chown; ``none`` ignores that.
        argv += ["-fsdev", f"local,id={share.tag},path={path},security_model=none{ro}"]
        argv += ["-device", f"virtio-9p-{bus},fsdev={share.tag},mount_tag={share.tag}"]
    return argv


def limit_plan(policy: Policy) -> LimitPlan:
    """The box's limits, held by the guest kernel's cgroup, in a VM sized for them."""
    caps = Capabilities(
        "guest cgroup v2",
        swap="inactive",  # the guest has no swap
        vm_memory_mb=vm_memory_mb(policy),
        vm_cpus=policy.vm.cpus,
    )
    return plan_limits(policy.limits, caps)


def _masks(spec: BoxSpec, shared: idmap.SharedPaths) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The guest paths to hide and to make read-only: the masks of :func:`layout.policy_binds`
    (the same rules as every backend: no mask follows a link, a missing ``deny_write`` path is
    made and masked, a masked object is masked wherever a share shows it), by guest path."""
    policy = spec.policy
    fs = policy.filesystem
    masked_file, masked_dir = Path("/corral-masked-file"), Path("/corral-masked-dir")
    make = safepath.placeholder_maker(spec.workspace, shared.workspace, shared.sources)
    binds = policy_binds(
        policy,
        shared.workspace,
        masked_file,
        masked_dir,
        maskfollow.host_view(policy, spec.workspace, make),
        shared.sources,
    )
    masks = binds[1 + len(fs.allow_write) + len(fs.mounts) :]
    hidden = tuple(b.dest for b in masks if b.source in (str(masked_file), str(masked_dir)))
    read_only = tuple(b.dest for b in masks if b.dest not in hidden)
    return hidden, read_only


def _image_of(spec: BoxSpec, shared: idmap.SharedPaths) -> tuple[Path, str | None] | None:
    """The root directory of ``policy.image`` as qemu's jail binds it from, and its
    ``WorkingDir`` (to make when the policy keeps the default workdir), or None for the
    host's system. As root the store is host root's alone (0700): the image is bound
    read-only (nosuid, nodev) on a staging mount point qemu's uid can reach, released with
    the box's shared paths. Blocking."""
    if spec.policy.image == "host":
        return None
    from corral.images import resolve_root

    resolved = resolve_root(spec.policy.image)
    if resolved is None or resolved.rootfs is None:
        return None
    workdir = resolved.config.workdir if spec.policy.workdir == DEFAULT_WORKDIR else None
    root = resolved.rootfs
    if os.geteuid() == 0:
        if shared.binds is None:
            shared.binds = idmap.IdmappedBinds(spec.sandbox_id)
        entry = staging.new_entry("mnt", f"{spec.sandbox_id}.vmimage")
        shared.binds.entries.append(entry)  # released with the box's shares
        # qemu's uid alone may enter (the store keeps images from other users: 0700)
        os.chown(entry, shared.uid, shared.gid)
        entry.chmod(0o700)
        mounts.bind(str(root), str(entry / "ws"))
        mounts.read_only(str(entry / "ws"))
        root = entry / "ws"
    return root, posixpath.join("/", workdir) if workdir else None


def boot_plan(
    spec: BoxSpec,
    shared: idmap.SharedPaths,
    limits: LimitPlan,
    image: tuple[Path, str | None] | None = None,
) -> tuple[initramfs.BootPlan, list[HostShare], list[jail.Share]]:
    """The guest's mounts, the qemu exports they come from (paths in the jail) and the host
    directories bound into the jail for them (pure but for ``HostView``'s stats).

    The workspace and the policy's shares are ``shared``'s idmapped mount points: the box
    user (guest uid 1000, qemu's uid) owns what the workspace owner owns on disk, and what it
    creates lands on disk as the owner's, as on the other backends."""
    policy = spec.policy
    fs = policy.filesystem
    uid = gid = BOX_UID
    host_shares = [
        HostShare("root", jail.VIEW, True),
        HostShare("ws", f"{jail.SHARES}/ws", False),
    ]
    jail_shares = [jail.Share("ws", str(shared.workspace), True)]
    shares = [initramfs.Share("ws", policy.workdir, False)]
    extra: list[tuple[str, str, bool]] = [(str(m.host), m.guest, m.mode == "ro") for m in fs.mounts]
    host = HostView()
    home = host.home
    extra += [(expand(p, home), expand(p, home), False) for p in fs.allow_write]
    for n, (source, guest, ro) in enumerate(extra):
        host_shares.append(HostShare(f"m{n}", f"{jail.SHARES}/m{n}", ro))
        jail_shares.append(jail.Share(f"m{n}", shared.sources.get(source, source), not ro))
        shares.append(initramfs.Share(f"m{n}", guest, ro))
    config = {
        **agent_config(spec, uid=uid, gid=gid),
        "device": "/dev/corral",
        # The same filter as the other backends, installed by the agent on itself (and so
        # inherited by every command): the guest kernel is one more layer, not the only one.
        "seccomp": f"{initramfs.GUEST_AGENT_DIR}/seccomp.bpf",
        "cgroup": initramfs.GUEST_CGROUP,  # the agent reports its counters with every exit
        "landlock": {"off": MICROVM_NO_LANDLOCK},
    }
    if spec.network is not None:  # forwarders over the corral-net port (no NIC, no 9p sockets)
        config["vmlink"] = vmlink.guest_config(spec.network)
        config["publishers"] = spec.network.linked_publishers()
    deny_read, deny_write = _masks(spec, shared)
    plan = initramfs.BootPlan(
        shares=tuple(shares),
        hostname="corral",  # as on the other backends
        uid=uid,
        gid=gid,
        tmp_size=fs.tmp_size,
        agent_config=json.dumps(config, separators=(",", ":")),
        deny_read=deny_read,
        deny_write=deny_write,
        checked=(policy.workdir, *(e[1] for e in extra if not e[2])),
        minimal_root=None if fs.inherit_readable or image else minimal_root(policy, host),
        root_dirs=() if image else view_dirs(policy, host),
        root_size=fs.root_size if image else None,
        read_only_root=image is not None and fs.root_size is None,
        make_dirs=(image[1],) if image and image[1] and fs.root_size is not None else (),
        passwd=passwd_text(uid, gid),
        group=group_text(gid),
        memory_max=limits.memory_max,
        pids_max=limits.pids_max,
        cpu_max_us=limits.cpu_quota_us,
    )
    return plan, host_shares, jail_shares


def system_view(policy: Policy, host: HostView) -> list[Bind | Symlink]:
    """What the guest's root is made of: the host entries of :func:`layout.root_entries`
    (each top-level entry, or the minimal root's few), bound read-only in qemu's jail at
    :data:`jail.VIEW` and exported as the ``root`` share."""
    return jail.view_entries(root_entries(policy, find_python(), host))


def view_dirs(policy: Policy, host: HostView) -> tuple[str, ...]:
    """Directories the view holds only as parents of nested entries (/var of /var/lib/dpkg):
    the jail makes them as qemu's uid, the box user's in the guest; the guest's root owns
    them, as on the other backends."""
    dirs: dict[str, None] = {}
    for entry in system_view(policy, host):
        parts = entry.dest.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            dirs["/" + "/".join(parts[: i + 1])] = None
    return tuple(dirs)


def minimal_root(policy: Policy, host: HostView) -> tuple[tuple[str, str], ...]:
    """The minimal root's entries for the VM's tmpfs root, as paths of the system view (the
    same layout on every backend; the guest writes its /etc/passwd)."""
    entries: list[tuple[str, str]] = []
    for entry in system_view(policy, host):
        if isinstance(entry, Symlink):
            entries.append(("->" + entry.target, entry.dest))
        else:  # bound at its box path in the view (a host symlink is followed there)
            entries.append((entry.dest, entry.dest))
    return tuple(entries)


# ---- probing the host ----------------------------------------------------------------------


async def raw_boot(
    qemu: str,
    boot: Boot,
    initrd: Path,
    timeout: float,
    cpus: int = 1,
    memory_mb: int = 256,
) -> float | None:
    """Seconds from spawning qemu to the raw-boot marker on the console (None: no marker)."""
    argv = qemu_argv(
        qemu, boot, initrd=initrd, cpus=cpus, memory_mb=memory_mb, extra_cmdline="corralmode=raw"
    )
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdout is not None
    elapsed: float | None = None
    try:
        async with asyncio.timeout(timeout):
            while line := await proc.stdout.readline():
                if initramfs.RAW_MARKER.encode() in line:
                    elapsed = time.monotonic() - started
                    break
            await proc.wait()  # the init powers off right after the marker
    except TimeoutError:
        pass
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return elapsed


def kvm_usable() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


_probed: dict[str, Boot] = {}


def _probe_inputs(qemu: str, kernel: initramfs.Kernel, accel: str) -> tuple[str, list[Path]]:
    """The probe's cache key and the kernel files to try (blocking: the first call extracts
    the kernel's ELF, see :func:`initramfs.boot_image`)."""
    qemu_path = shutil.which(qemu) or qemu
    images = list(dict.fromkeys([initramfs.boot_image(kernel), kernel.image]))
    key = (
        f"{accel}:{qemu_path}:{os.stat(qemu_path).st_mtime_ns}:{kernel.version}:{kvm_usable()}"
        f":{','.join(map(str, images))}"
    )
    return key, images


def _saved_probe(key: str) -> Boot | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads((cache_root() / "microvm" / "probe.json").read_text())
        if saved["key"] == key:
            return Boot(str(saved["accel"]), str(saved["machine"]), Path(saved["image"]))
    return None


async def probe(qemu: str, kernel: initramfs.Kernel, base: Path, accel: str) -> Boot:
    """The first (accel, machine, kernel file) that boots the raw initramfs; cached per host
    and inputs. The extracted kernel is tried before the bzImage (it boots seconds faster)."""
    key, images = await blocking(_probe_inputs, qemu, kernel, accel)
    if key in _probed:
        return _probed[key]
    saved = await blocking(_saved_probe, key)
    if saved is not None:
        _probed[key] = saved
        return saved
    cache = cache_root() / "microvm" / "probe.json"
    accels = {"auto": ["kvm", "tcg"] if kvm_usable() else ["tcg"], "kvm": ["kvm"], "tcg": ["tcg"]}
    tried: list[str] = []
    for acc in accels[accel]:
        for machine in MACHINES[acc]:
            for image in images:
                boot = Boot(acc, machine, image)
                if await raw_boot(qemu, boot, base, PROBE_TIMEOUT[acc]) is not None:
                    record = {"key": key, "accel": acc, "machine": machine, "image": str(image)}
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    cache.write_text(json.dumps(record))
                    _probed[key] = boot
                    return boot
                tried.append(f"{acc}/{machine}/{image.name}")
    raise BackendUnavailable(
        f"qemu could not boot {kernel.image} here (tried {', '.join(tried)}); run "
        "`corral doctor`, check that the kernel boots with `qemu-system-x86_64 -accel tcg`, "
        "or set vm.accel to 'tcg' when /dev/kvm cannot run this kernel"
    )


# ---- orphans -------------------------------------------------------------------------------


def _make_group(
    made: list[cgroups.Cgroup],
    name: str,
    limits: cgroups.CgroupLimits,
    support: cgroups.CgroupSupport,
) -> None:
    """Create qemu's cgroup into ``made``, where the caller finds it even if it was
    cancelled while this ran."""
    made.append(cgroups.Cgroup.create(name, limits, support))


def sweep_orphans(support: cgroups.CgroupSupport | None = None) -> list[str]:
    """Kill the VMs of dead owners and remove their state directories, then the cgroups and
    idmapped mounts nobody owns any more."""
    boxes = state_root() / "boxes"
    removed = sweep_boxes(
        "microvm",
        lambda _, owner: kill_if_named(int(owner.get("qemu_pid", 0) or 0), "qemu-system"),
    )
    staging.sweep_staging()
    if os.geteuid() != 0:
        return removed  # an ordinary user's qemu has no host cgroup
    with contextlib.suppress(BackendError):
        cgroups.sweep_orphans(
            lambda name: not name.startswith(BOX_PREFIX) or (boxes / name).exists(), support
        )
    return removed


# ---- the box -------------------------------------------------------------------------------


ROOTLESS_NOTE = (
    "rootless: qemu runs as you, jailed in a user namespace, without a host cgroup (the box's "
    "limits hold in the guest; qemu's own memory is bounded by the VM's RAM, not by a host "
    "cgroup); the shares are your own directories, not idmapped"
)
"""The warning of every microVM box started by an ordinary user."""


class _Saved(Exception):
    """The booting VM was saved (and is killed): start the box from the saved file."""


class BootStalled(BackendError):
    """The VM did not reach its snapshot point in time (killed; the backend boots again)."""


class LayoutRefused(BackendError):
    """The guest's init refused the box's own layout (:data:`protocol.VM_REFUSED`): another
    boot would be refused the same, and the saved VM it restored is not to blame."""


class MicroVmBox(BoxBase):
    backend = "microvm"
    _net_sock: socket.socket | None = None
    _netlink: vmlink.VmLink | None = None

    def __init__(
        self,
        spec: BoxSpec,
        vm: _Jailed,
        channel: socket.socket,
        boot: Boot,
        kernel: initramfs.Kernel,
        warnings: tuple[str, ...],
        how: str,
        snapshot: Path | None,
        limits: LimitPlan,
    ) -> None:
        super().__init__(spec, channel, warnings, limits)
        self._proc = vm.proc
        vm.proc.reap_on_exit()  # a dead VM's jail is no zombie until close
        self._qemu_pid = vm.qemu_pid
        self._cgroup = vm.cgroup
        self._shared: idmap.SharedPaths | None = None
        self._boot = boot
        self._kernel = kernel
        self.boot_how = how
        self._guest = BoxStats()
        self._snapshot = snapshot

    @property
    def qemu_pid(self) -> int:
        """qemu's host pid (PID 1 of its own pid namespace; ``self._proc`` is bwrap's)."""
        return self._qemu_pid

    def hold(self, shared: idmap.SharedPaths) -> None:
        """The idmapped mounts of this box's shares: released once qemu is gone."""
        self._shared = shared
        self.user_ids = (shared.uid, shared.gid)

    def oom_kills(self) -> int:
        return self._guest.oom_kills

    def pids_limit_hits(self) -> int:
        return self._guest.pids_limit_hits

    def observe_counters(self, counters: object) -> None:
        """The guest cgroup's accounting, as the agent sends it with every command's exit
        (the host sees no cgroup of the box): what :meth:`stats` reports since. The guest is
        the untrusted side: malformed values are ignored and the counts never go down."""
        if not isinstance(counters, dict):
            return

        def number(key: str) -> int | None:
            value = counters.get(key)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            return value if ok else None

        old = self._guest
        usec = number("cpu_usec")
        self._guest = BoxStats(
            memory_bytes=number("memory_bytes"),
            memory_peak_bytes=number("memory_peak_bytes"),
            oom_kills=max(old.oom_kills, number("oom_kills") or 0),
            pids=number("pids"),
            pids_limit_hits=max(old.pids_limit_hits, number("pids_limit_hits") or 0),
            cpu_seconds=None if usec is None else usec / 1e6,
        )

    def stats(self) -> BoxStats:
        """The guest cgroup's accounting as of the last command's exit; before any, the
        qemu process's resident memory and CPU time (the whole VM, seen from the host)."""
        if self._guest != BoxStats():
            return self._guest
        try:
            fields = Path(f"/proc/{self._qemu_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return BoxStats()
        tick = os.sysconf("SC_CLK_TCK")
        return BoxStats(
            memory_bytes=int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
            cpu_seconds=(int(fields[11]) + int(fields[12])) / tick,
        )

    def _facts(self) -> dict[str, Any]:
        vm = self._spec.policy.vm
        return {
            "accel": self._boot.accel,
            "machine": self._boot.machine,
            "vm_cpus": vm.cpus,
            "vm_memory_mb": vm_memory_mb(self._spec.policy),
            "kernel_image": str(self._kernel.image),
            "boot": self.boot_how,
            "snapshot": None if self._snapshot is None else str(self._snapshot),
            "qemu_pid": self._qemu_pid,
            "rootless": os.geteuid() != 0,
        }

    def stop(self) -> None:
        """Kill the VM: nothing of the guest runs once qemu is gone (bwrap's death kills
        qemu too: ``--die-with-parent``)."""
        if self._cgroup is not None:
            with contextlib.suppress(Exception):
                self._cgroup.kill_all(wait=False)
        self._proc.kill()

    async def diagnose(self) -> str:
        """qemu's error output and the end of the guest console."""
        parts = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):  # a VM that failed is usually exiting right now
                await self._proc.wait()
        if self._proc.returncode is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1):
                    err = await self._proc.stderr(4096)
                    if err:
                        parts.append(f"qemu: {err}")
        tail = console_tail(self._spec.state_dir / RUN_DIR / "console.log")
        if tail:
            parts.append(f"guest console: ...{tail}")
        return "; ".join(parts)

    async def attach_network(self, sock: socket.socket) -> None:
        """Serve the ``corral-net`` port when the network mode forwards anything; hold it
        (unused) otherwise, so no VM ever sees its host end close."""
        self._net_sock = sock
        net = self._spec.network
        if net is not None:
            sock.setblocking(False)
            self._netlink = vmlink.VmLink(net.unix_forwarders(), net.audit)
            self._netlink.start(*await asyncio.open_connection(sock=sock))

    async def _teardown(self) -> None:
        if self._netlink is not None:
            await self._netlink.close()  # ends every forwarded connection
        if self._net_sock is not None:
            self._net_sock.close()
        # After the agent's shutdown the guest's PID 1 exits and the VM powers off itself.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE):
                await self._proc.wait()
        if self._proc.returncode is None:
            self._proc.kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._proc.wait()
        self._proc.close()
        await self._release_host(self._cgroup, self._shared, kill=True)


_bases: dict[tuple[str, str], Path] = {}


def _base_archive(kernel: initramfs.Kernel, python: str) -> Path:
    """:func:`initramfs.base_archive`, once per process (it hashes every input file)."""
    key = (str(kernel.image), python)
    base = _bases.get(key)
    if base is None or not base.exists():
        base = _bases[key] = initramfs.base_archive(kernel, python)
    return base


@dataclass
class _Jailed:
    """A jailed qemu being started: bwrap (``proc``), qemu inside it, qemu's cgroup."""

    proc: HostChild
    qemu_pid: int
    cgroup: cgroups.Cgroup | None


class MicroVmBackend(BackendBase):
    name = "microvm"

    @classmethod
    def for_policy(cls, policy: Policy) -> MicroVmBackend:
        return cls(policy)

    def __init__(self, policy: Policy) -> None:
        qemu = shutil.which(QEMU)
        if qemu is None:
            raise BackendUnavailable(
                "qemu is not installed; `apt-get install qemu-system-x86 linux-image-amd64 "
                "busybox-static` (or `make setup`), then `corral doctor`"
            )
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise BackendUnavailable(
                "the microvm backend jails qemu with bubblewrap, which is not installed; "
                "`apt-get install bubblewrap`"
            )
        if policy.network.mode == "full":
            raise BackendUnavailable(
                "network mode 'full' is not available on the microvm backend: its VMs have no "
                "NIC; use network.mode 'allowlist' (HTTP/SOCKS proxy) or 'ports' (host "
                "loopback ports), or the bwrap or oci backend for 'full'"
            )
        # As an ordinary user qemu runs as that user (jailed alike, in a user namespace
        # bwrap makes unprivileged), the shares are the user's own directories (no idmapped
        # mounts: what the box writes belongs to the user) and qemu has no host cgroup.
        self.rootless = os.geteuid() != 0
        if policy.vm.accel == "kvm" and not kvm_usable():
            raise BackendUnavailable("vm.accel is 'kvm' but /dev/kvm is missing or not usable")
        try:
            self.kernel = initramfs.find_kernel(policy.vm.kernel)
            initramfs.check_busybox()
        except initramfs.KernelNotFound as exc:
            raise BackendUnavailable(str(exc)) from None
        self.python = find_python()
        self.qemu = qemu
        self.bwrap = bwrap
        self.accel = policy.vm.accel
        self.cgroup_support = None if self.rootless else cgroups.detect()
        self._base: Path | None = None

    def sweep_orphans(self) -> list[str]:
        return sweep_orphans(self.cgroup_support)

    @property
    def base(self) -> Path:
        """The base initramfs, once :meth:`prepare` has built or found it."""
        if self._base is None:
            raise BackendError("the microVM backend is not prepared: await prepare() first")
        return self._base

    async def prepare(self) -> None:
        """The orphan sweep, then the base initramfs (built once, cached on disk) and qemu's
        runtime files (``ldd``, once per binary): in threads, never on the event loop."""
        await super().prepare()
        if self._base is None:
            try:
                self._base = await blocking(_base_archive, self.kernel, self.python)
            except initramfs.KernelNotFound as exc:
                raise BackendUnavailable(str(exc)) from None
            await blocking(jail.runtime, self.qemu)

    async def boot_mode(self) -> Boot:
        await self.prepare()
        return await probe(self.qemu, self.kernel, self.base, self.accel)

    async def start(self, spec: BoxSpec) -> MicroVmBox:
        """Restore the saved VM of this shape when there is one, else boot (and save it)."""
        if spec.policy.user == "root" or spec.user == "root":
            refuse_image(spec, "microvm")
        limits = limit_plan(spec.policy)  # a refusal comes before anything starts
        problem = _ram_problem(spec.policy)
        if problem is not None:
            raise PolicyError(problem)
        boot = await self.boot_mode()
        if self.rootless:
            shared = idmap.SharedPaths(spec.workspace, uid=os.getuid(), gid=os.getgid())
        else:
            shared = idmap.share_paths(spec)
        try:
            box = await self._start(spec, boot, shared, limits)
        except BaseException:
            shared.release()
            raise
        box.hold(shared)
        return box

    async def _start(
        self, spec: BoxSpec, boot: Boot, shared: idmap.SharedPaths, limits: LimitPlan
    ) -> MicroVmBox:
        policy = spec.policy
        if shared.uid == 0 or shared.gid == 0:
            raise BackendError(
                f"{shared.warning}: qemu would run as host root with this root-owned "
                "workspace; use a workspace owned by a regular user"
            )
        image = await blocking(_image_of, spec, shared)
        plan, shares, jail_shares = boot_plan(spec, shared, limits, image)
        plan = replace(plan, seccomp=seccomp.build_filter(policy.security.preset))
        devices = box_devices(boot, shares)
        shape = vmsnap.Shape(
            qemu=self.qemu,
            image=str(boot.image),
            initrd=str(self.base),
            accel=boot.accel,
            machine=boot.machine,
            cpus=policy.vm.cpus,
            memory_mb=vm_memory_mb(policy),
            shares=len(shares),
            # The device layout without per-box paths, and the kernel's command line (in the
            # saved memory too).
            devices=re.sub(r"path=[^,]*", "path=", " ".join(devices)) + " -append " + KERNEL_ARGS,
        )
        snapshot = vmsnap.snapshot_path(shape) if policy.vm.snapshot else None
        notes: list[str] = [shared.warning] if shared.warning else []
        if self.rootless:
            notes.append(ROOTLESS_NOTE)
        view = (
            system_view(policy, HostView())
            if image is None
            else jail.view_entries(image_entries(image[0]))
        )
        vm = _VmStart(self, spec, boot, plan, limits, devices, jail_shares, shared, view)
        if snapshot is not None and snapshot.exists():
            try:
                return await vm.run(restore=snapshot, notes=notes)
            except LayoutRefused:
                raise
            except BackendError as exc:  # a stale or damaged file: boot, and save a new one
                await blocking(vmsnap.discard, snapshot)  # a 70-100 MiB file: off-loop
                notes.append(f"the saved VM did not restore ({exc.message}); booted instead")
        try:
            try:
                return await vm.run(save=snapshot, notes=notes)
            except BootStalled as exc:  # rare under TCG on a loaded host: one more try
                notes.append(f"the first boot stalled ({exc.message}); booted again")
                return await vm.run(save=snapshot, notes=notes)
        except _Saved:
            assert snapshot is not None
        try:
            box = await vm.run(restore=snapshot, notes=notes)
        except LayoutRefused:
            raise
        except BackendError as exc:
            await blocking(vmsnap.discard, snapshot)  # a 70-100 MiB file: off-loop
            notes.append(f"the VM just saved did not restore ({exc.message}); booted instead")
            return await vm.run(notes=notes)
        box.boot_how = "booted, saved and restored"
        return box


@dataclass
class _VmStart:
    """One box's VM as the backend starts it: each :meth:`run` is one jailed qemu."""

    backend: MicroVmBackend
    spec: BoxSpec
    boot: Boot
    plan: initramfs.BootPlan
    limits: LimitPlan
    devices: list[str]
    shares: list[jail.Share]
    shared: idmap.SharedPaths
    view: list[Bind | Symlink]
    """What the guest's root is made of: the system view, or an image's entries."""

    def _run_dir(self) -> Path:
        """The run directory, owned by qemu's host uid (0700): made anew for each qemu."""
        run_dir = self.spec.state_dir / RUN_DIR
        self.spec.state_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(mode=0o700)
        if not self.backend.rootless:
            os.chown(run_dir, self.shared.uid, self.shared.gid)
        return run_dir

    async def _spawn(self, argv: list[str], keep: list[int]) -> _Jailed:
        """bwrap, holding qemu (blocked before its exec) until qemu is in its cgroup."""
        b = self.backend
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        fds = jail.JailFds()
        cgroup: cgroups.Cgroup | None = None
        proc: HostChild | None = None
        kvm = self.boot.accel == "kvm"
        try:
            try:
                full = jail.jail_argv(
                    b.bwrap,
                    argv,
                    rt=jail.runtime(b.qemu),
                    fds=fds,
                    run_dir=str(self.spec.state_dir / RUN_DIR),
                    boot_files=[str(self.boot.image), str(b.base)],
                    view=self.view,
                    shares=self.shares,
                    info_fd=info_w,
                    block_fd=block_r,
                    kvm=kvm,
                )
            except OSError as exc:  # a share or system path gone since the policy named it
                why = exc.strerror or exc
                raise BackendError(f"cannot bind {exc.filename} into qemu's jail: {why}") from None
            if b.cgroup_support is not None and b.cgroup_support.version != "none":
                vm_mb = vm_memory_mb(self.spec.policy)
                limits = cgroups.CgroupLimits(
                    memory_bytes=(vm_mb + jail.MEMORY_OVERHEAD_MB) << 20,
                    max_pids=jail.PIDS_MAX,
                )
                # a cgroup v1 group is five directories and their limit files: off-loop
                made: list[cgroups.Cgroup] = []
                try:
                    await blocking(
                        _make_group, made, self.spec.sandbox_id, limits, b.cgroup_support
                    )
                finally:
                    cgroup = made[0] if made else None
            # qemu's own ids (as root); as a user, its own (and its groups, /dev/kvm's). A
            # dropper program switches them after the exec: subprocess's user=/group= fork
            # this whole process holding the GIL (tens of ms in a large one, the loop frozen).
            ids: dict[str, Any] = {}
            dropper: tuple[str, ...] = ()
            if not b.rootless:
                groups = (os.stat("/dev/kvm").st_gid,) if kvm else ()
                uid, gid = self.shared.uid, self.shared.gid
                found = await blocking(dropids.as_ids, uid, gid, groups)
                if found is None:
                    ids = {"user": uid, "group": gid, "extra_groups": list(groups)}
                else:
                    dropper = found
            proc = await spawn(
                [*dropper, *full],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(*fds.fds, info_w, block_r, *keep),
                env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
                start_new_session=True,
                **ids,
            )
            os.close(info_w)
            info_w = -1
            reader, transport = await _pipe_reader(info_r)
            info_r = -1
            try:
                what = "bwrap failed to jail qemu"
                child = await _until(proc, _read_info(reader), CONNECT_TIMEOUT, what)
            finally:
                transport.close()
            if cgroup is not None:  # a cgroup v1 move waits for an RCU grace period: off-loop
                await blocking(cgroup.add, child)
            write_owner(self.spec.state_dir, "microvm", qemu_pid=child, bwrap_pid=proc.pid)
            os.write(block_w, b"1")
            return _Jailed(proc, child, cgroup)
        except BaseException:
            if proc is not None:
                proc.kill()
                await proc.wait()
                proc.close()
            if cgroup is not None:
                await blocking(cgroup.remove)
            raise
        finally:
            fds.close()
            for fd in (info_r, info_w, block_r, block_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    async def run(
        self,
        *,
        restore: Path | None = None,
        save: Path | None = None,
        notes: list[str] | None = None,
    ) -> MicroVmBox:
        b, spec, boot = self.backend, self.spec, self.boot
        policy = spec.policy
        notes = list(notes or [])
        run_dir = self._run_dir()
        sock_path = run_dir / CHANNEL_SOCKET
        net_path = run_dir / NET_SOCKET
        qmp_path = run_dir / "qmp.sock"
        argv = qemu_argv(
            b.qemu,
            boot,
            initrd=b.base,
            cpus=policy.vm.cpus,
            memory_mb=vm_memory_mb(policy),
            serial=f"file:{jail.RUN}/console.log",
        )
        # The box's id names the VM (``ps`` on the host shows which box a qemu is: its
        # paths are the jail's, the same for every box).
        argv += ["-name", spec.sandbox_id, *self.devices, "-sandbox", jail.SANDBOX]
        # The saved VM is read from a descriptor qemu inherits (and written to one it gets
        # over QMP: vmsnap.save).
        snap_fd = -1
        if restore is not None:
            snap_fd = os.open(restore, os.O_RDONLY | os.O_CLOEXEC)
            argv += vmsnap.incoming_args(snap_fd)
        elif save is not None:
            argv += vmsnap.qmp_args(Path(jail.RUN) / "qmp.sock")
        timeout = _agent_timeout(spec, boot.accel, restored=restore is not None)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        net_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        accepted: list[socket.socket] = []
        vm: _Jailed | None = None
        loop = asyncio.get_running_loop()
        try:
            for server, server_path in ((listener, sock_path), (net_listener, net_path)):
                server.bind(str(server_path))
                os.chown(server_path, self.shared.uid, self.shared.gid)
                server.listen(1)
                server.setblocking(False)
            vm = await self._spawn(argv, [snap_fd] if snap_fd >= 0 else [])
            proc = vm.proc
            what = "qemu failed to start the microVM"
            channel, _ = await _until(proc, loop.sock_accept(listener), CONNECT_TIMEOUT, what)
            accepted.append(channel)
            net_sock, _ = await _until(proc, loop.sock_accept(net_listener), CONNECT_TIMEOUT, what)
            accepted.append(net_sock)
            how = "restored"
            if restore is None:
                what = "the microVM's kernel did not boot"
                try:
                    await _until(proc, _read_marker(channel), STALL_TIMEOUT[boot.accel], what)
                except BackendError as exc:
                    raise BootStalled(exc.message) from None
                how = "booted"
                if save is not None:
                    try:
                        step = vmsnap.save(qmp_path, save)
                        await _until(proc, step, timeout, "saving the VM")
                    except BackendError as exc:
                        notes.append(f"could not save the VM for the next boxes: {exc.message}")
                    else:
                        # This VM stays paused: the box starts from the file just written, the
                        # path every later box takes. (Resuming a VM after its migration left
                        # its channel deaf now and then under TCG.)
                        raise _Saved()
            else:
                vmsnap.touch(restore)
            await loop.sock_sendall(channel, initramfs.boot_payload(self.plan, time.time()))
            what = _agent_late(spec, restored=restore is not None)
            await _until(proc, _readable(channel), timeout, what)
        except BaseException as exc:
            if vm is not None:
                await _kill(vm)
            for sock in accepted:
                sock.close()
            tail = console_tail(run_dir / "console.log")
            _clear_attempt(spec)
            if isinstance(exc, BackendError) and tail:
                kind = LayoutRefused if protocol.VM_REFUSED in tail else type(exc)
                raise kind(f"{exc.message}; guest console: ...{tail}") from None
            raise
        finally:
            if snap_fd >= 0:
                os.close(snap_fd)
            listener.close()
            net_listener.close()
            sock_path.unlink(missing_ok=True)
            net_path.unlink(missing_ok=True)
        # The guest's cgroup holds the limits: the warnings are the plan's (a CPU quota above
        # the VM's CPUs) and how the VM started, when it did not go as planned.
        warnings = (*self.limits.warnings, *notes)
        box = MicroVmBox(spec, vm, channel, boot, b.kernel, warnings, how, restore, self.limits)
        await box.attach_network(net_sock)
        return box


def _agent_timeout(spec: BoxSpec, accel: str, *, restored: bool) -> float:
    """Seconds a VM gets to its agent's first frame: the caller's ``ready_timeout`` for a
    boot, else the default for the accelerator (a restore past its own is booted instead)."""
    if restored:
        return RESTORE_TIMEOUT[accel]
    return spec.ready_timeout if spec.ready_timeout is not None else BOOT_TIMEOUT[accel]


def _agent_late(spec: BoxSpec, *, restored: bool) -> str:
    """What the error says when the agent's first frame does not come in time."""
    if restored or spec.ready_timeout is None:
        return "the microVM's guest agent did not start"
    limit = f"{spec.ready_timeout:g} s"
    return f"the microVM's guest agent did not start within the {limit} of ready_timeout"


async def _kill(vm: _Jailed) -> None:
    """Kill a jailed qemu and wait for it; remove its cgroup."""
    vm.proc.kill()
    # Bounded: a start cancelled at the wrong moment (an enclosing timeout) was seen to
    # never get the exit of the killed jail reported; the cgroup kill below still ends it.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            await vm.proc.wait()
    vm.proc.close()
    await BoxBase._release_host(vm.cgroup, kill=True)


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A reader of pipe ``fd`` (which it owns from now on: closed with the transport)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader, transport


async def _read_info(reader: asyncio.StreamReader) -> int:
    """The pid of bwrap's child (qemu to be) from its ``--info-fd`` JSON."""
    data = b""
    while b"}" not in data:
        chunk = await reader.read(4096)
        if not chunk:
            raise BackendError("bwrap exited before qemu's namespaces existed")
        data += chunk
    return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])


async def _until(proc: HostChild, step: Awaitable[T], timeout: float, what: str) -> T:
    """``step``'s result, or BackendError naming ``what`` when qemu exits or time runs out
    (with qemu's own error message when it printed one)."""
    task = asyncio.ensure_future(step)
    exited = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait(
            {task, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        exited.cancel()
    if task in done and not (isinstance(task.exception(), BackendError) or exited in done):
        return task.result()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if exited not in done:
            raise BackendError(f"{what} (no answer within {timeout:g} s)")
    detail = ""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1):  # a channel that failed: qemu is usually exiting now
            await proc.wait()
    if proc.returncode is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):
                detail = await proc.stderr(4096)
    if not detail:
        failure = task.exception() if task.done() and not task.cancelled() else None
        detail = str(failure) if failure else f"qemu exited with status {proc.returncode}"
    raise BackendError(f"{what}: {detail}")


def console_tail(path: Path, size: int = 1500) -> str:
    """The end of the guest's console (kernel messages, the init's and the agent's errors).

    The file is in qemu's run directory, which a compromised qemu controls: a symlink or
    anything but a regular file is not read (its tail would go into an error message)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return ""
            window = max(size, 64 << 10)  # the init's own sentence, before a panic's trace
            f.seek(max(0, st.st_size - window))
            text = f.read(window).decode(errors="replace")
        except OSError:
            return ""
    tail = text[-size:].strip()
    said = text.rfind("corral-init:")
    if said >= 0 and said < len(text) - size:
        return text[said:].split("\n", 1)[0].strip() + " ... " + tail
    return tail


async def _read_marker(channel: socket.socket) -> None:
    """Read the agent's snapshot-point line (it writes nothing else before the payload)."""
    loop = asyncio.get_running_loop()
    line = b""
    while not line.endswith(b"\n"):
        chunk = await loop.sock_recv(channel, 1)
        if not chunk:
            raise BackendError("the microVM closed its channel during boot")
        line += chunk
        if len(line) > 256:
            break
    if line.strip() != initramfs.SNAPSHOT_MARKER.encode():
        raise BackendError(f"the microVM's init sent {line[:80]!r} instead of its boot marker")


async def _readable(channel: socket.socket) -> None:
    """Until the agent's first frame (``ready``) is readable, without consuming it."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(channel.fileno(), on_readable)
    try:
        await readable
    finally:
        loop.remove_reader(channel.fileno())
    try:
        first = channel.recv(1, socket.MSG_PEEK)
    except OSError as exc:
        raise BackendError(f"the channel failed ({exc})") from None
    if not first:
        raise BackendError("qemu closed the channel")


# ---- corral doctor -------------------------------------------------------------------------


def host_report() -> list[tuple[str, bool, str, str]]:
    """``(name, ok, detail, fix)`` rows for ``corral doctor``: qemu, the kernel, and which
    accelerator and machine really boot (KVM is tried, not assumed; the result is cached)."""
    rows: list[tuple[str, bool, str, str]] = []
    qemu = shutil.which(QEMU)
    fix_qemu = "apt-get install qemu-system-x86 linux-image-amd64 busybox-static"
    rows.append(
        ("microvm: qemu", qemu is not None, qemu or "not installed", "" if qemu else fix_qemu)
    )
    try:
        kernel = initramfs.find_kernel()
        base = initramfs.base_archive(kernel, find_python())
        rows.append(("microvm: kernel", True, f"{kernel.image} (9p, virtio modules)", ""))
    except initramfs.KernelNotFound as exc:
        rows.append(("microvm: kernel", False, str(exc), "apt-get install linux-image-amd64"))
        return rows
    if qemu is None:
        return rows
    bwrap = shutil.which("bwrap")
    detail = (
        f"qemu runs as an unprivileged uid in namespaces of its own (bwrap: {bwrap}), on a "
        "root of its own, under its -sandbox seccomp filter and a cgroup"
        if bwrap and os.geteuid() == 0
        else f"rootless: qemu runs as you in namespaces of its own (bwrap: {bwrap}), on a root "
        "of its own, under its -sandbox seccomp filter; no host cgroup (the box's limits hold "
        "in the guest, qemu's memory is bounded by the VM's RAM)"
        if bwrap
        else "bubblewrap is not installed: qemu cannot be jailed, the backend is unavailable"
    )
    rows.append(
        ("microvm: jail", bwrap is not None, detail, "" if bwrap else "apt-get install bubblewrap")
    )
    try:
        boot = asyncio.run(probe(qemu, kernel, base, "auto"))
    except BackendUnavailable as exc:
        rows.append(("microvm: boot", False, exc.message, "see the qemu and kernel rows"))
        return rows
    if boot.accel == "kvm":
        detail = f"KVM boots the kernel ({boot.machine} machine)"
    elif kvm_usable():
        detail = (
            f"/dev/kvm is present but could not boot the kernel (tried): software emulation "
            f"(TCG, {boot.machine} machine), seconds per cold boot"
        )
    else:
        detail = f"no usable /dev/kvm: software emulation (TCG, {boot.machine} machine)"
    fix = "" if boot.accel == "kvm" else "run on a host with working (nested) KVM for fast boots"
    rows.append(("microvm: accel", boot.accel == "kvm", detail, fix))
    direct = boot.image != kernel.image
    how = "its uncompressed ELF (PVH entry)" if direct else "the bzImage (no PVH entry found)"
    rows.append(("microvm: kernel file", True, f"qemu loads {how}: {boot.image}", ""))
    saved = sorted(vmsnap.snapshot_dir().glob("*.vm"))
    size = sum(p.stat().st_size for p in saved) >> 20
    detail = (
        f"{len(saved)} saved VM(s), {size} MiB in {vmsnap.snapshot_dir()}; the first VM of a new "
        "shape boots and saves itself, the next ones restore (vm.snapshot)"
    )
    rows.append(("microvm: saved VMs", True, detail, ""))
    return rows


def _clear_attempt(spec: BoxSpec) -> None:
    """Remove what a boot attempt left in the box's state directory, except the sandbox's
    network directory: its proxy and relay sockets serve the next attempt (a boot that saved
    the VM is followed by a restore)."""
    keep = spec.network.host_dir if spec.network is not None else None
    for entry in list(spec.state_dir.iterdir()) if spec.state_dir.is_dir() else ():
        if entry == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
