"""``corral doctor``: what this host supports, and how to fix what is missing."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bwrap", False, "bubblewrap is not installed", "apt-get install bubblewrap")
    return Check("bwrap", True, f"{path} ({_version([path, '--version'])})")


def check_root() -> Check:
    if os.geteuid() == 0:
        return Check("privileges", True, "running as root: uid maps and cgroups can be set up")
    return Check(
        "privileges",
        True,
        "not root: boxes run rootless (backend bwrap-rootless); the checks 'rootless ...' "
        "below say what differs from root mode",
    )


def check_rootless() -> list[Check]:
    """What an ordinary user's boxes get, each difference from root mode named with its fix."""
    if os.geteuid() == 0:
        return []
    from corral.backends.host import subids
    from corral.backends.host.subids import NO_CGROUP

    found = subids.probe()
    checks = []
    if found.userns_problem is not None:
        checks.append(Check("rootless user namespaces", False, found.userns_problem))
    if found.mapped:
        s = found.subids
        checks.append(
            Check(
                "rootless ids",
                True,
                f"{found.user}: box root -> subordinate uid {s.uid_start} (gid {s.gid_start}), "
                f"commands -> your own uid {found.uid}: files they write are yours; they cannot "
                "signal or inspect the guest agent",
            )
        )
    else:
        checks.append(
            Check(
                "rootless ids",
                False,
                "single id mapping: commands run as the guest agent's id (no capabilities), so "
                "a command can signal the agent and keeps your supplementary groups",
                found.separation_problem or "",
                required=False,
            )
        )
    from corral.backends.host import cgroups

    delegated = cgroups.delegated_v2()
    fallback = (
        "limits.memory_bytes -> RLIMIT_AS per process, limits.max_pids -> RLIMIT_NPROC, "
        "limits.cpu_quota not enforced (each box lists these in warnings and "
        "info()['unenforced'])"
    )
    full = delegated is not None and delegated.controllers >= {"memory", "pids", "cpu"}
    detail = f"{NO_CGROUP}: {fallback}"
    if delegated is not None:
        detail = f"{delegated.reason}: each box gets a group there"
        detail += "" if full else f"; what it lacks falls back: {fallback}"
    checks.append(
        Check(
            "rootless limits",
            full,
            detail,
            ""
            if full
            else "give corral a delegated cgroup v2 subtree with memory, pids and cpu "
            "(systemd-run --user --scope -p Delegate=yes corral ..., or CORRAL_CGROUP_DELEGATE="
            "a group root chowned to you that holds corral in a child group), or run as root",
            required=False,
        )
    )
    checks.append(
        Check(
            "rootless differences",
            False,
            "no warm pool (its staging mounts are root's: every claim starts a box); "
            "workspaces and shares are not idmapped (commands act as you in them); no host "
            "uids of a box's own, so your boxes share your kernel quotas (inotify, message "
            "queues, queued signals, pipe pages) and take no PTY pool slot (each is still "
            "capped at 64 PTYs); capped temporary workspaces (filesystem.workspace_size) are "
            "refused; bwrap's pid 1 in the box has the commands' id (they "
            "can list its descriptor numbers, not open them); network full runs pasta as you",
            "run corral as root for these",
            required=False,
        )
    )
    return checks


def check_userns() -> Check:
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = -1
    if limit == 0:
        return Check(
            "user namespaces",
            False,
            "disabled (max_user_namespaces = 0)",
            "sysctl -w user.max_user_namespaces=15000",
        )
    return Check("user namespaces", True, f"enabled (max_user_namespaces = {limit})")


def check_cgroups() -> Check:
    from corral.backends.host import cgroups

    if os.geteuid() != 0:
        return Check(
            "cgroups",
            True,
            "rootless: the host's cgroups are root's, not used; the 'rootless limits' check "
            "says what holds a box's limits (a delegated subtree, or rlimits)",
            required=False,
        )
    support = cgroups.detect()
    if support.version == "none":
        return Check(
            "cgroups",
            False,
            support.reason,
            "run as root on a host with cgroup v1 or v2 controllers mounted",
            required=False,
        )
    controllers = ", ".join(sorted(support.controllers))
    return Check("cgroups", True, f"{support.version} at {support.root} ({controllers})")


def check_seccomp() -> Check:
    try:
        actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        return Check(
            "seccomp", False, "seccomp filters unavailable", "use a kernel with SECCOMP_FILTER"
        )
    ok = "errno" in actions and "kill_process" in actions
    return Check("seccomp", ok, "filters available (" + " ".join(actions) + ")")


def check_landlock() -> Check:
    """Landlock, the boxes' second filesystem layer (``security.landlock``, on by default)."""
    from corral.backends import landlock

    abi, why = landlock.host_abi()
    if abi < 2:
        detail = why if abi < 1 else f"ABI {abi} is too old (needs 2+: Linux 5.19)"
        return Check(
            "landlock",
            False,
            f"not enforced: {detail}",
            "boot with lsm=...,landlock",
            required=False,
        )
    rootless = "; rootless too (the agent applies it, no privilege needed)"
    return Check(
        "landlock",
        True,
        f"ABI {abi}: boxes enforce their view twice (security.landlock)"
        + (rootless if os.geteuid() != 0 else ""),
        required=False,
    )


def check_tool(name: str, purpose: str, package: str) -> Check:
    path = shutil.which(name)
    if path is None:
        return Check(
            name, False, f"not installed ({purpose})", f"apt-get install {package}", required=False
        )
    return Check(name, True, f"{path} ({purpose})", required=False)


def check_kvm() -> Check:
    if not os.path.exists("/dev/kvm"):
        return Check(
            "kvm",
            False,
            "/dev/kvm absent: microVMs would use software emulation (TCG)",
            required=False,
        )
    usable = os.access("/dev/kvm", os.R_OK | os.W_OK)
    return Check(
        "kvm",
        usable,
        "/dev/kvm present"
        + ("" if usable else " but not accessible")
        + "; whether it boots a stock kernel is only known by trying (microVM backend)",
        required=False,
    )


def check_microvm() -> list[Check]:
    """qemu, a kernel with 9p, and which accelerator really boots it (KVM tried, not assumed)."""
    from corral.backends.microvm import box as microvm

    return [
        Check(name, ok, detail, fix, required=False)
        for name, ok, detail, fix in microvm.host_report()
    ]


def check_sandbox() -> Check:
    """Start a real box and run `true` in it: the only check that proves everything."""
    import asyncio

    from corral.errors import SandboxError
    from corral.sandbox import Sandbox

    async def go() -> str:
        async with Sandbox() as sb:
            r = await sb.run(["true"], timeout=10)
            return f"exit {r.exit_code}"

    try:
        detail = asyncio.run(go())
    except SandboxError as exc:
        return Check("sandbox", False, exc.message, "see the failing checks above")
    return Check("sandbox", True, f"a real box started and ran `true` ({detail})")


def check_oci_runtime(name: str) -> Check:
    """Whether the OCI backend starts boxes with runtime ``name``: a real box runs `true`."""
    import asyncio

    from corral.backends.layout import PTY_MAX
    from corral.backends.oci import box as oci
    from corral.errors import SandboxError
    from corral.policy import Policy
    from corral.sandbox import Sandbox

    try:
        runtime = oci.find_runtime(name)
    except SandboxError as exc:
        return Check(name, False, f"OCI backend: {exc.message}", required=False)
    where = f"{runtime.path} ({_version([runtime.path, '--version'])})"
    if runtime.gvisor:
        compat, why = oci.gvisor_compat_library()
        where += (
            "; gVisor: commands run on its own kernel (ptrace platform), no user namespace, "
            "network modes none/allowlist/ports"
        )
        where += f"; {why}" if compat is None else "; stat compatibility library built"
    if runtime.hidden_mount:
        where += (
            f"; this host mixes cgroup v1 and v2, which crun refuses, so corral runs it in a "
            f"private mount namespace without {runtime.hidden_mount}"
        )
    if runtime.rootless is not None:
        ids = (
            "box root -> your first subordinate id, commands -> you"
            if runtime.rootless.mapped
            else "one id: agent and commands are you (commands with no capability)"
        )
        where += (
            f"; rootless: {name} runs in a user namespace of yours mapping your ids ({ids}), "
            "the box's group is one in your delegated cgroup v2 subtree if you have one (the "
            "'rootless limits' check), limits it cannot enforce are rlimits, a devpts capped "
            f"at {PTY_MAX} PTYs, network none/allowlist/ports (full: use backend bwrap)"
        )

    async def go() -> int:
        async with Sandbox(Policy.from_dict({"backend": "oci", "runtime": name})) as sb:
            return (await sb.run(["true"], timeout=10)).exit_code

    try:
        code = asyncio.run(go())
    except SandboxError as exc:
        return Check(
            name,
            False,
            f"{where}; it cannot start a box here: {exc.message}",
            f"run `corral run --backend oci --runtime {name} -- true` for details",
            required=False,
        )
    return Check(name, code == 0, f"{where}; a real OCI box started and ran `true`", required=False)


def check_network_modes() -> list[Check]:
    from corral.net.support import mode_support

    return [
        Check(f"network {m.mode}", m.ok, m.detail, m.fix, required=False) for m in mode_support()
    ]


def check_idmap() -> Check:
    """Idmapped workspaces: commands an unprivileged host uid even for a root-owned one."""
    if os.geteuid() != 0:
        return Check(
            "idmapped mounts",
            True,
            "rootless: not used (mounting them needs root): commands run as you (with "
            "subordinate ids) or as box root = you (one id), so what they write is yours",
            required=False,
        )
    from corral.backends.host import idmap
    from corral.backends.users import COMMAND_UID_BASE

    reason = idmap.unsupported_reason()
    if reason is None:
        return Check(
            "idmapped mounts",
            True,
            "workspaces are idmapped: each box's commands run as a host uid of their own "
            f"(from {COMMAND_UID_BASE})",
        )
    return Check(
        "idmapped mounts",
        False,
        reason,
        "Linux 5.12+ with a filesystem that supports idmapped mounts (ext4, xfs, btrfs; "
        "tmpfs from 6.3); until then commands have the workspace owner's host uid",
        required=False,
    )


def run_checks() -> list[Check]:
    checks = [
        check_bwrap(),
        check_root(),
        *check_rootless(),
        check_userns(),
        check_idmap(),
        check_cgroups(),
        check_seccomp(),
        check_landlock(),
    ]
    checks += [
        *check_network_modes(),
        *(check_oci_runtime(name) for name in ("runc", "crun", "runsc")),
        check_tool("qemu-system-x86_64", "microVM backend", "qemu-system-x86"),
        check_kvm(),
        *check_microvm(),
    ]
    if all(c.ok for c in checks if c.required):
        checks.append(check_sandbox())
    return checks


def register(sub: SubParsers) -> None:
    doctor = sub.add_parser("doctor", help="check what this host supports and how to fix it")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks()
    if args.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("warn" if not c.required else "FAIL")
            print(f"[{mark}] {c.name}: {c.detail}")
            if not c.ok and c.fix:
                print(f"       fix: {c.fix}")
    return 0 if all(c.ok for c in checks if c.required) else 1
