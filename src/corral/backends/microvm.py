"""The microVM backend: the same guest agent, as PID 1 of a qemu VM.

Start-up sequence::

    1. find the kernel (newest /boot/vmlinuz-* with 9p modules) and corral's cached base
       initramfs; append the box's /boot.sh (its shares and ids) as a second small archive
    2. probe, once per host (cached on disk), which accelerator and machine boot here:
       KVM is tried, never assumed (a /dev/kvm that cannot run a stock kernel is common in
       nested setups); ``microvm`` first under KVM, ``q35`` first under TCG (see MACHINES)
    3. listen on a unix socket in the box's state directory; qemu connects to it as the
       client end of the virtio-serial port named ``corral``: the accepted socket is the
       channel, and no NIC exists unless the network mode asks (none is supported yet)
    4. the guest mounts the host root (9p, read-only) under a tmpfs overlay, the workspace and
       the policy's mounts (9p), private /tmp /run /home, and switch_roots into the agent

A box's state directory records ``"backend": "microvm"`` and qemu's pid; boxes whose owner
died are killed and removed by the next :class:`MicroVmBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.backends import initramfs, seccomp
from corral.backends.base import BOX_UID, BoxBase, BoxSpec, BoxStats, orphaned_boxes, state_root
from corral.backends.bwrap import find_python
from corral.backends.bwrap_args import HostView, expand, guest_path
from corral.errors import BackendError, BackendUnavailable
from corral.policy import Policy

QEMU = "qemu-system-x86_64"
CONNECT_TIMEOUT = 10.0
"""qemu connects to the channel socket while it sets up devices, before the guest runs."""
SHUTDOWN_GRACE = 3.0
"""After the agent's ``shutdown`` the guest powers off by itself; then qemu is killed."""
PROBE_TIMEOUT = {"kvm": 5.0, "tcg": 30.0}
BOOT_TIMEOUT = {"kvm": 15.0, "tcg": 90.0}
# Machine types to try, in order. Under TCG, Debian's kernel on ``microvm`` (no PIT/HPET
# reference) intermittently fails to calibrate the TSC and hangs before init: q35 first.
MACHINES = {"kvm": ("microvm", "q35"), "tcg": ("q35", "microvm")}
"""Boot to the agent's first frame (software emulation on a busy host takes many seconds)."""
# Quiet, no device probing the box never uses; panic (the agent, PID 1, exiting) powers off.
KERNEL_ARGS = (
    "console=ttyS0 quiet loglevel=1 panic=-1 reboot=t 8250.nr_uarts=1 i8042.noaux i8042.nomux"
    " i8042.nopnp i8042.dumbkbd tsc=reliable no_timer_check cryptomgr.notests"
    " random.trust_cpu=on"
)


@dataclass(frozen=True, slots=True)
class Boot:
    """How VMs boot on this host: accelerator and machine type (from the probe)."""

    accel: str
    machine: str


def qemu_argv(
    qemu: str,
    boot: Boot,
    *,
    kernel: Path,
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
    argv += ["-kernel", str(kernel), "-initrd", str(initrd)]
    argv += ["-append", f"{KERNEL_ARGS} {extra_cmdline}".strip()]
    return argv


@dataclass(frozen=True, slots=True)
class HostShare:
    tag: str
    host: str
    read_only: bool
    mapped: bool = False
    """Ownership as the guest sets it lives in xattrs (``mapped-xattr``), not on the host."""


def box_devices(boot: Boot, channel_path: Path, shares: list[HostShare]) -> list[str]:
    """The virtio-serial channel port and the 9p shares (pure)."""
    bus = "device" if boot.machine == "microvm" else "pci"
    argv = ["-chardev", f"socket,id=corral,path={channel_path}"]
    argv += [
        "-device",
        f"virtio-serial-{bus}",
        "-device",
        "virtserialport,chardev=corral,name=corral",
    ]
    for share in shares:
        model = "mapped-xattr" if share.mapped else "none"
        ro = ",readonly=on" if share.read_only else ""
        # The host root spans several filesystems: keep their inode numbers apart.
        ro += ",multidevs=remap" if share.host == "/" else ""
        path = share.host.replace(",", ",,")
        argv += ["-fsdev", f"local,id={share.tag},path={path},security_model={model}{ro}"]
        argv += ["-device", f"virtio-9p-{bus},fsdev={share.tag},mount_tag={share.tag}"]
    return argv


def guest_ids(workspace: Path) -> tuple[int, int, bool]:
    """The command user's uid and gid in the guest, and whether the workspace share is mapped.

    9p shows the host's owners to the guest. A workspace owned by a regular user is used as
    that user (files it writes belong to them on the host); a root-owned one (corral run as
    root with a temporary workspace) is shared with ``mapped-xattr`` and handed to uid 1000,
    so commands never run as the guest's root and nothing is chowned on the host.
    """
    st = workspace.stat()
    if st.st_uid == 0:
        return BOX_UID, BOX_UID, True
    return st.st_uid, st.st_gid, False


def boot_plan(spec: BoxSpec, python: str) -> tuple[initramfs.BootPlan, list[HostShare]]:
    """The guest's mounts and the qemu shares they come from (pure but for a stat)."""
    policy = spec.policy
    fs = policy.filesystem
    uid, gid, mapped = guest_ids(spec.workspace)
    host_shares = [
        HostShare("root", "/", True),
        HostShare("ws", str(spec.workspace), False, mapped=mapped),
    ]
    shares = [initramfs.Share("ws", policy.workdir, False)]
    extra: list[tuple[str, str, bool]] = [(str(m.host), m.guest, m.mode == "ro") for m in fs.mounts]
    host = HostView()
    home = host.home
    extra += [(expand(p, home), expand(p, home), False) for p in fs.allow_write]
    for n, (source, guest, ro) in enumerate(extra):
        host_shares.append(HostShare(f"m{n}", source, ro))
        shares.append(initramfs.Share(f"m{n}", guest, ro))
    config = {
        "device": "/dev/corral",
        "uid": uid,
        "gid": gid,
        "info": {"sandbox_id": spec.sandbox_id, "workdir": policy.workdir},
        # The same filter as the other backends, installed by the agent on itself (and so
        # inherited by every command): the guest kernel is one more layer, not the only one.
        "seccomp": f"{initramfs.GUEST_AGENT_DIR}/seccomp.bpf",
    }
    plan = initramfs.BootPlan(
        shares=tuple(shares),
        hostname=spec.sandbox_id,
        uid=uid,
        gid=gid,
        tmp_size=fs.tmp_size,
        python=python,
        agent_config=json.dumps(config, separators=(",", ":")),
        own_workdir=policy.workdir if mapped else None,
        deny_read=tuple(guest_path(p, policy, host) for p in fs.deny_read),
        deny_write=tuple(guest_path(p, policy, host) for p in fs.deny_write),
    )
    return plan, host_shares


# ---- probing the host ----------------------------------------------------------------------


async def raw_boot(
    qemu: str,
    boot: Boot,
    kernel: Path,
    initrd: Path,
    timeout: float,
    cpus: int = 1,
    memory_mb: int = 256,
) -> float | None:
    """Seconds from spawning qemu to the raw-boot marker on the console (None: no marker)."""
    argv = qemu_argv(
        qemu, boot, kernel=kernel, initrd=initrd, cpus=cpus, memory_mb=memory_mb,
        extra_cmdline="corralmode=raw",
    )  # fmt: skip
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


async def probe(qemu: str, kernel: initramfs.Kernel, base: Path, accel: str) -> Boot:
    """The first (accel, machine) that boots the raw initramfs; cached per host and inputs."""
    qemu_path = shutil.which(qemu) or qemu
    key = f"{accel}:{qemu_path}:{os.stat(qemu_path).st_mtime_ns}:{kernel.version}:{kvm_usable()}"
    if key in _probed:
        return _probed[key]
    cache = state_root() / "microvm" / "probe.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            _probed[key] = Boot(str(saved["accel"]), str(saved["machine"]))
            return _probed[key]
    accels = {"auto": ["kvm", "tcg"] if kvm_usable() else ["tcg"], "kvm": ["kvm"], "tcg": ["tcg"]}
    tried: list[str] = []
    for acc in accels[accel]:
        for machine in MACHINES[acc]:
            boot = Boot(acc, machine)
            if await raw_boot(qemu, boot, kernel.image, base, PROBE_TIMEOUT[acc]) is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps({"key": key, "accel": acc, "machine": machine}))
                _probed[key] = boot
                return boot
            tried.append(f"{acc}/{machine}")
    raise BackendUnavailable(
        f"qemu could not boot {kernel.image} here (tried {', '.join(tried)}); run "
        "`corral doctor`, check that the kernel boots with `qemu-system-x86_64 -accel tcg`, "
        "or set vm.accel to 'tcg' when /dev/kvm cannot run this kernel"
    )


# ---- orphans -------------------------------------------------------------------------------


def _is_qemu(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("qemu-system")
    except OSError:
        return False


def sweep_orphans() -> list[str]:
    """Kill the VMs of dead owners and remove their state directories."""
    removed: list[str] = []
    for entry, owner in orphaned_boxes("microvm"):
        qemu_pid = int(owner.get("qemu_pid", 0) or 0)
        if qemu_pid and _is_qemu(qemu_pid):
            with contextlib.suppress(OSError):
                os.kill(qemu_pid, signal.SIGKILL)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


# ---- the box -------------------------------------------------------------------------------


class MicroVmBox(BoxBase):
    def __init__(
        self,
        spec: BoxSpec,
        proc: asyncio.subprocess.Process,
        channel: socket.socket,
        boot: Boot,
        kernel: initramfs.Kernel,
        warnings: tuple[str, ...],
    ) -> None:
        super().__init__(spec, channel, warnings)
        self._proc = proc
        self._boot = boot
        self._kernel = kernel

    @property
    def qemu_pid(self) -> int:
        return self._proc.pid

    def oom_kills(self) -> int:
        return 0

    def stats(self) -> BoxStats:
        """The qemu process's resident memory and CPU time (the whole VM, seen from the host)."""
        try:
            fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return BoxStats()
        tick = os.sysconf("SC_CLK_TCK")
        return BoxStats(
            memory_bytes=int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
            cpu_seconds=(int(fields[11]) + int(fields[12])) / tick,
        )

    def describe(self) -> dict[str, Any]:
        vm = self._spec.policy.vm
        return {
            "backend": "microvm",
            "sandbox_id": self._spec.sandbox_id,
            "accel": self._boot.accel,
            "machine": self._boot.machine,
            "vm_cpus": vm.cpus,
            "vm_memory_mb": vm.memory_mb,
            "kernel_image": str(self._kernel.image),
            "qemu_pid": self._proc.pid,
            "unenforced": list(self._warnings),
        }

    async def diagnose(self) -> str:
        """qemu's error output and the end of the guest console."""
        parts = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):  # a VM that failed is usually exiting right now
                await self._proc.wait()
        if self._proc.returncode is not None and self._proc.stderr is not None:
            with contextlib.suppress(TimeoutError, OSError):
                async with asyncio.timeout(1):
                    err = (await self._proc.stderr.read(4096)).decode(errors="replace").strip()
                    if err:
                        parts.append(f"qemu: {err}")
        with contextlib.suppress(OSError):
            console = (self._spec.state_dir / "console.log").read_bytes()[-1500:]
            tail = console.decode(errors="replace").strip()
            if tail:
                parts.append(f"guest console: ...{tail}")
        return "; ".join(parts)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._channel.close()
        # After the agent's shutdown the guest's PID 1 exits and the VM powers off itself.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE):
                await self._proc.wait()
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._proc.wait()
        shutil.rmtree(self._spec.state_dir, ignore_errors=True)


class MicroVmBackend:
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
        if policy.network.mode != "none":
            raise BackendUnavailable(
                f"network mode {policy.network.mode!r} is not available on the microvm backend "
                "yet; use network.mode 'none' or the bwrap backend"
            )
        if not policy.filesystem.inherit_readable:
            raise BackendUnavailable(
                "filesystem.inherit_readable = false (a minimal root) is not available on the "
                "microvm backend yet; use the bwrap backend or inherit_readable = true"
            )
        if os.geteuid() != 0:
            raise BackendUnavailable(
                "the microvm backend shares the host root with the VM and needs root; run "
                "corral as root"
            )
        if policy.vm.accel == "kvm" and not kvm_usable():
            raise BackendUnavailable("vm.accel is 'kvm' but /dev/kvm is missing or not usable")
        try:
            self.kernel = initramfs.find_kernel(policy.vm.kernel)
            self.base = initramfs.base_archive(self.kernel)
        except initramfs.KernelNotFound as exc:
            raise BackendUnavailable(str(exc)) from None
        self.qemu = qemu
        self.accel = policy.vm.accel
        self.python = find_python()
        sweep_orphans()

    async def boot_mode(self) -> Boot:
        return await probe(self.qemu, self.kernel, self.base, self.accel)

    async def start(self, spec: BoxSpec) -> MicroVmBox:
        boot = await self.boot_mode()
        policy = spec.policy
        spec.state_dir.mkdir(parents=True, exist_ok=True)
        plan, shares = boot_plan(spec, self.python)
        initrd = initramfs.box_archive(
            self.base,
            initramfs.boot_script(plan),
            spec.state_dir / "initrd.cpio",
            seccomp.build_filter(policy.security.preset),
        )
        sock_path = spec.state_dir / "chan.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = qemu_argv(
            self.qemu,
            boot,
            kernel=self.kernel.image,
            initrd=initrd,
            cpus=policy.vm.cpus,
            memory_mb=policy.vm.memory_mb,
            serial=f"file:{spec.state_dir / 'console.log'}",
        ) + box_devices(boot, sock_path, shares)
        proc: asyncio.subprocess.Process | None = None
        try:
            listener.bind(str(sock_path))
            listener.listen(1)
            listener.setblocking(False)
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            owner = {
                "backend": "microvm",
                "host_pid": os.getpid(),
                "qemu_pid": proc.pid,
                "created": time.time(),
            }
            (spec.state_dir / "owner.json").write_text(json.dumps(owner))
            channel = await self._accept(listener, proc)
            await self._wait_for_agent(channel, proc, BOOT_TIMEOUT[boot.accel])
        except BaseException:
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
            shutil.rmtree(spec.state_dir, ignore_errors=True)
            raise
        finally:
            listener.close()
            sock_path.unlink(missing_ok=True)
        channel.setblocking(False)
        return MicroVmBox(spec, proc, channel, boot, self.kernel, self._warnings(policy))

    async def _accept(
        self, listener: socket.socket, proc: asyncio.subprocess.Process
    ) -> socket.socket:
        loop = asyncio.get_running_loop()
        accept = asyncio.ensure_future(loop.sock_accept(listener))
        exited = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait(
            {accept, exited}, timeout=CONNECT_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        if accept in done:
            exited.cancel()
            conn, _ = accept.result()
            return conn
        accept.cancel()
        exited.cancel()
        err = b""
        if proc.returncode is not None and proc.stderr is not None:
            err = await proc.stderr.read(4096)
        detail = (
            err.decode(errors="replace").strip() or f"no connection within {CONNECT_TIMEOUT:g} s"
        )
        raise BackendError(f"qemu failed to start the microVM: {detail}")

    async def _wait_for_agent(
        self, channel: socket.socket, proc: asyncio.subprocess.Process, timeout: float
    ) -> None:
        """Wait until the agent's first frame (``ready``) is readable, without consuming it.

        The VM boots for longer than a container starts (seconds under TCG): the backend owns
        this wait, so the sandbox's own ready timeout only covers the agent's first frame.
        """
        loop = asyncio.get_running_loop()
        readable = loop.create_future()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(channel.fileno(), on_readable)
        exited = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait(
                {readable, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            loop.remove_reader(channel.fileno())
            exited.cancel()
            readable.cancel()
        if readable not in done:
            why = "the VM exited" if exited in done else f"no answer within {timeout:g} s"
            raise BackendError(f"the microVM's guest agent did not start ({why})")

    def _warnings(self, policy: Policy) -> tuple[str, ...]:
        limits = policy.limits
        out = []
        if limits.max_pids is not None:
            out.append("max_pids limit not enforced (microvm: the VM bounds the box)")
        if limits.cpu_quota is not None:
            out.append("cpu_quota limit not enforced (microvm: use vm.cpus)")
        if limits.memory_bytes is not None and limits.memory_bytes < policy.vm.memory_mb << 20:
            out.append("memory limit not enforced below the VM's size (microvm: use vm.memory_mb)")
        return tuple(out)


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
        base = initramfs.base_archive(kernel)
        rows.append(("microvm: kernel", True, f"{kernel.image} (9p, virtio modules)", ""))
    except initramfs.KernelNotFound as exc:
        rows.append(("microvm: kernel", False, str(exc), "apt-get install linux-image-amd64"))
        return rows
    if qemu is None:
        return rows
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
            f"(TCG, {boot.machine} machine), seconds per boot"
        )
    else:
        detail = f"no usable /dev/kvm: software emulation (TCG, {boot.machine} machine)"
    fix = "" if boot.accel == "kvm" else "run on a host with working (nested) KVM for fast boots"
    rows.append(("microvm: accel", boot.accel == "kvm", detail, fix))
    return rows
