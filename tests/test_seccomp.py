"""Tests of the seccomp filter compiler: structure, semantics, and real programs under bwrap.

The semantic unit tests run the compiled program in a small classic-BPF interpreter below
(the filter uses only loads, ``jeq``, ``jset`` and ``ret``). The bwrap tests install the
filter for real and check both that ordinary tools still work and that each refused syscall
fails with the promised errno. Every probe is chosen so that *without* the filter the kernel
answers differently (ENOENT, EFAULT, EINVAL, EBADF, success, ...), and a control run without
``--seccomp`` proves it, so an EPERM seen under the filter is the filter's doing.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.backends.host import seccomp
from corral.backends.host.seccomp import (
    ALLOW,
    ENOSYS,
    EPERM,
    KILL_PROCESS,
    Profile,
    build_filter,
    denied_syscalls,
)
from corral.errors import BackendUnavailable, PolicyError

PROFILES: Final[tuple[Profile, ...]] = ("baseline", "restricted")
AUDIT_ARCH_X86_64: Final = 0xC000003E
AUDIT_ARCH_I386: Final = 0x40000003
AUDIT_ARCH_AARCH64: Final = 0xC00000B7
U32: Final = 0xFFFFFFFF
U64: Final = 0xFFFFFFFFFFFFFFFF

# ---------------------------------------------------------------------------------------------
# A classic-BPF interpreter, just enough for seccomp programs.

_INSN = struct.Struct("=HBBI")
_SECCOMP_DATA = struct.Struct("=IIQ6Q")  # nr, arch, instruction_pointer, args[6]


def decode(program: bytes) -> list[tuple[int, int, int, int]]:
    assert len(program) % 8 == 0
    return [(code, jt, jf, k) for code, jt, jf, k in _INSN.iter_unpack(program)]


def run_bpf(
    program: bytes, nr: int, args: Sequence[int] = (), arch: int = AUDIT_ARCH_X86_64
) -> int:
    """The action ``program`` returns for this syscall."""
    data = _SECCOMP_DATA.pack(nr, arch, 0, *args, *[0] * (6 - len(args)))
    insns = decode(program)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            (acc,) = struct.unpack_from("=I", data, k)
            pc += 1
        elif code == 0x15:  # jeq #k
            pc += 1 + (jt if acc == k else jf)
        elif code == 0x45:  # jset #k
            pc += 1 + (jt if acc & k else jf)
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x} at {pc}")


def host_filter(profile: Profile) -> bytes:
    # Unit tests are about the x86_64 program whatever machine they run on.
    return seccomp._compile(profile, "x86_64")


NR = seccomp._X86_64
NS_FLAGS: Final = 0x7E020080
SET_ID_SYSCALLS: Final = frozenset(seccomp._SET_ID_RULES)
ARG_RULE_SYSCALLS: Final = (
    frozenset({"clone", "unshare", "ioctl", "personality", "socket"}) | SET_ID_SYSCALLS
)
ENOSYS_SYSCALLS: Final = frozenset({"clone3", "openat2"})
NEWER_THAN_HEADERS: Final = {"fchmodat2": 452}
"""Syscalls newer than the linux-libc-dev of some hosts (fchmodat2: Linux 6.6)."""
POLICY_NRS: Final = frozenset(
    NR[name] for name in denied_syscalls("restricted") | ARG_RULE_SYSCALLS
)

# ---------------------------------------------------------------------------------------------
# Structure.


@pytest.mark.parametrize("profile", PROFILES)
def test_program_is_well_formed(profile: Profile) -> None:
    program = build_filter(profile)
    insns = decode(program)
    assert 0 < len(insns) < 4096
    for pc, (code, jt, jf, k) in enumerate(insns):
        assert code in {0x20, 0x15, 0x45, 0x06}
        assert 0 <= k <= U32
        if code == 0x20:
            assert k % 4 == 0
            assert k < _SECCOMP_DATA.size
        if code in {0x15, 0x45}:
            # Forward, 8-bit, and landing inside the program.
            assert pc + 1 + max(jt, jf) < len(insns)
    assert insns[-1][0] == 0x06


@pytest.mark.parametrize("profile", PROFILES)
def test_build_filter_is_deterministic_and_cached(profile: Profile) -> None:
    first = build_filter(profile)
    assert build_filter(profile) is first
    seccomp._compile.cache_clear()
    again = build_filter(profile)
    assert again == first
    assert again is not first


def test_aarch64_program_compiles() -> None:
    program = seccomp._compile("restricted", "aarch64")
    assert len(program) % 8 == 0
    assert run_bpf(program, 40, arch=AUDIT_ARCH_AARCH64) == EPERM  # mount
    assert run_bpf(program, 435, arch=AUDIT_ARCH_AARCH64) == ENOSYS  # clone3
    assert run_bpf(program, 220, [0x10000000], AUDIT_ARCH_AARCH64) == EPERM  # CLONE_NEWUSER
    assert run_bpf(program, 172, arch=AUDIT_ARCH_AARCH64) == ALLOW  # getpid
    # x86_64 code on an aarch64 filter is foreign; no x32 rule there.
    assert run_bpf(program, 40, arch=AUDIT_ARCH_X86_64) == KILL_PROCESS
    assert run_bpf(program, 0x40000000 | 172, arch=AUDIT_ARCH_AARCH64) == ALLOW


def test_unknown_profile_rejected() -> None:
    with pytest.raises(PolicyError, match="unknown seccomp profile"):
        build_filter("permissive")  # type: ignore[arg-type]
    with pytest.raises(PolicyError):
        denied_syscalls("nope")  # type: ignore[arg-type]


def test_unsupported_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    with pytest.raises(BackendUnavailable, match="riscv64"):
        build_filter()


def test_denied_syscalls() -> None:
    baseline, restricted = denied_syscalls("baseline"), denied_syscalls("restricted")
    assert baseline < restricted
    assert {"mount", "ptrace", "bpf", "io_uring_setup", "keyctl", "clone3"} <= baseline
    assert {"process_madvise", "modify_ldt"} <= restricted - baseline
    # Argument-dependent rules are not "denied".
    assert not ARG_RULE_SYSCALLS & restricted
    assert restricted <= NR.keys()


def _header_numbers(path: Path) -> dict[str, int]:
    pattern = re.compile(r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", re.MULTILINE)
    return {name: int(nr) for name, nr in pattern.findall(path.read_text())}


@pytest.mark.parametrize(
    ("table", "header"),
    [
        (seccomp._X86_64, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        (seccomp._AARCH64, "/usr/include/asm-generic/unistd.h"),
    ],
    ids=["x86_64", "aarch64"],
)
def test_syscall_numbers_match_kernel_headers(table: dict[str, int], header: str) -> None:
    if not Path(header).exists():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    numbers = _header_numbers(Path(header))
    numbers = {**NEWER_THAN_HEADERS, **numbers}
    assert {name: numbers.get(name) for name in table} == dict(table)


# ---------------------------------------------------------------------------------------------
# Semantics, through the interpreter.


@pytest.mark.parametrize("profile", PROFILES)
def test_every_denied_syscall_is_refused(profile: Profile) -> None:
    program = host_filter(profile)
    for name in denied_syscalls(profile):
        expected = ENOSYS if name in ENOSYS_SYSCALLS else EPERM
        assert run_bpf(program, NR[name], [U64] * 6) == expected, name


@given(nr=st.integers(0, 600), args=st.lists(st.integers(0, U64), min_size=6, max_size=6))
def test_other_syscalls_are_allowed(nr: int, args: list[int]) -> None:
    if nr in POLICY_NRS:
        return
    for profile in PROFILES:
        assert run_bpf(host_filter(profile), nr, args) == ALLOW


@given(nr=st.integers(0, U32), arch=st.integers(0, U32))
def test_foreign_architectures_are_killed(nr: int, arch: int) -> None:
    if arch == AUDIT_ARCH_X86_64:
        return
    assert run_bpf(host_filter("baseline"), nr, arch=arch) == KILL_PROCESS


def test_i386_and_x32_are_refused() -> None:
    program = host_filter("baseline")
    assert run_bpf(program, 20, arch=AUDIT_ARCH_I386) == KILL_PROCESS  # i386 getpid
    assert run_bpf(program, 0x40000000 | NR["ioctl"], [0, 0x5412]) == EPERM
    assert run_bpf(program, 0x40000000 | 39) == EPERM  # x32 getpid


@given(request=st.integers(0, U64))
def test_ioctl_compares_the_low_word_only(request: int) -> None:
    expected = EPERM if request & U32 in {0x5412, 0x541C} else ALLOW
    assert run_bpf(host_filter("baseline"), NR["ioctl"], [3, request]) == expected


@given(request=st.sampled_from([0x5412, 0x541C]), high=st.integers(0, U32), fd=st.integers(0, U64))
def test_ioctl_upper_bits_do_not_bypass(request: int, high: int, fd: int) -> None:
    assert run_bpf(host_filter("baseline"), NR["ioctl"], [fd, high << 32 | request]) == EPERM


@pytest.mark.parametrize("name", ["clone", "unshare"])
@given(flags=st.integers(0, U64))
def test_namespace_flags_refused(name: str, flags: int) -> None:
    expected = EPERM if flags & NS_FLAGS else ALLOW
    assert run_bpf(host_filter("baseline"), NR[name], [flags, 0, 0, 0, 0, 0]) == expected


def test_ordinary_clone_flags_allowed() -> None:
    fork_flags = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
    thread_flags = 0x3D0F00  # what glibc's pthread_create passes
    program = host_filter("baseline")
    assert run_bpf(program, NR["clone"], [fork_flags]) == ALLOW
    assert run_bpf(program, NR["clone"], [thread_flags]) == ALLOW
    assert run_bpf(program, NR["unshare"], [0x400]) == ALLOW  # CLONE_FILES


@given(persona=st.integers(0, U64))
def test_personality(persona: int) -> None:
    expected = ALLOW if persona & U32 in {0, 8, U32} else EPERM
    assert run_bpf(host_filter("baseline"), NR["personality"], [persona]) == expected


@given(
    domain=st.integers(0, 64) | st.integers(0, U64),
    protocol=st.integers(0, 32) | st.integers(0, U64),
)
def test_restricted_socket_families(domain: int, protocol: int) -> None:
    low_domain, low_protocol = domain & U32, protocol & U32
    allowed = low_domain in {1, 2, 10} or (low_domain == 16 and low_protocol == 0)
    nr = NR["socket"]
    assert run_bpf(host_filter("restricted"), nr, [domain, 3, protocol]) == (
        ALLOW if allowed else EPERM
    )
    assert run_bpf(host_filter("baseline"), nr, [domain, 3, protocol]) == ALLOW


# ---------------------------------------------------------------------------------------------
# Real programs under bwrap.

BWRAP: Final = "/usr/bin/bwrap"
BWRAP_BASE: Final = (
    BWRAP,
    "--unshare-all",
    "--die-with-parent",
    "--ro-bind",
    "/",
    "/",
    "--dev",
    "/dev",
    "--proc",
    "/proc",
)
PYTHON: Final = ("/usr/bin/python3", "-I", "-S", "-c")


def run_sandboxed(
    argv: Sequence[str], profile: Profile | None, extra: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` under bwrap, with the ``profile`` filter passed through a memfd."""
    command = [*BWRAP_BASE, *extra]
    fds: list[int] = []
    if profile is not None:
        fd = os.memfd_create("corral-seccomp")
        fds.append(fd)
        program = build_filter(profile)
        assert os.write(fd, program) == len(program)
        os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads from the current offset to EOF
        command += ["--seccomp", str(fd)]
    try:
        return subprocess.run(
            [*command, "--", *argv],
            pass_fds=fds,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(scope="module")
def bwrap_works() -> None:
    if not Path(BWRAP).exists():
        pytest.skip(f"{BWRAP} is not installed")
    if not hasattr(os, "memfd_create"):
        pytest.skip("os.memfd_create is unavailable")
    if platform.machine() != "x86_64":
        pytest.skip("the probes (raw syscall numbers, int 0x80) are written for x86_64")
    trial = run_sandboxed(["/bin/true"], None)
    if trial.returncode != 0:
        pytest.skip(f"bwrap cannot create a sandbox here: {trial.stderr.strip()}")


# Each probe runs in a forked child (so a successful unshare or TIOCSCTTY cannot leak into the
# next probe) and reports errno (0 = the call succeeded) or -signal if the child was killed.
PROBE: Final = r"""
import ctypes, fcntl, json, mmap, os, termios

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def sc(nr, *args):
    conv = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *conv)
    return ctypes.get_errno() if r == -1 else 0

def raw_clone(flags):
    r = libc.syscall(ctypes.c_long(56), *[ctypes.c_ulong(a) for a in (flags, 0, 0, 0, 0)])
    if r == 0:
        os._exit(0)  # the child of a fork-like raw clone
    if r > 0:
        os.waitpid(r, 0)
        return 0
    return ctypes.get_errno()

def ctty_pty():
    os.setsid()
    _master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)  # TIOCSTI needs the controlling terminal
    return slave

def tiocsti(request, fd=None):
    return sc(16, ctty_pty() if fd is None else fd, request, ctypes.byref(ctypes.c_char(b"x")))

def int80_getpid():
    # mov eax, 20 (i386 getpid); int 0x80; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return 0 if fn() > 0 else 1

winsz = ctypes.create_string_buffer(8)
PROBES = {
    "unshare_user": lambda: sc(272, 0x10000000),
    "unshare_net": lambda: sc(272, 0x40000000),
    "unshare_files": lambda: sc(272, 0x400),
    "clone_newuser": lambda: raw_clone(0x10000000 | 17),
    "clone_plain": lambda: raw_clone(17),
    "clone3": lambda: sc(435, None, 0),
    "mount": lambda: sc(165, b"none", b"/nonexistent-corral", b"tmpfs", 0, None),
    "ptrace_traceme": lambda: sc(101, 0, 0, 0, 0),
    "keyctl": lambda: sc(250, 9999, 0, 0, 0, 0),
    "bpf": lambda: sc(321, 9999, None, 0),
    "perf_event_open": lambda: sc(298, None, 0, -1 & 0xFFFFFFFF, -1 & 0xFFFFFFFF, 0),
    "io_uring_setup": lambda: sc(425, 1, None),
    "tiocsti": lambda: tiocsti(0x5412),
    "tiocsti_high_bits": lambda: tiocsti(0xDEAD0000_00005412),
    "tiocsti_bad_fd": lambda: tiocsti(0x5412, fd=0xFFFFFFFF),
    "tioclinux": lambda: tiocsti(0x541C),
    "tiocgwinsz": lambda: sc(16, ctty_pty(), termios.TIOCGWINSZ, winsz),
    "personality_query": lambda: sc(135, 0xFFFFFFFF),
    "personality_no_aslr": lambda: sc(135, 0x0040000),
    "x32_getpid": lambda: sc(0x40000000 | 39),
    "int80_getpid": int80_getpid,
    "socket_unix": lambda: sc(41, 1, 1, 0),
    "socket_unix_high_bits": lambda: sc(41, 1 << 32 | 1, 1, 0),
    "socket_inet": lambda: sc(41, 2, 2, 0),
    "socket_inet6": lambda: sc(41, 10, 2, 0),
    "socket_packet": lambda: sc(41, 17, 3, 0x0300),
    "socket_packet_bad_type": lambda: sc(41, 17, 999, 0),
    "socket_packet_high_bits": lambda: sc(41, 1 << 32 | 17, 999, 0),
    "socket_netlink_route": lambda: sc(41, 16, 3, 0),
    "socket_netlink_netfilter": lambda: sc(41, 16, 3, 12),
}

results = {}
for name, probe in PROBES.items():
    pid = os.fork()
    if pid == 0:
        try:
            code = probe()
        except BaseException:
            code = 254
        os._exit(min(code, 253))
    _, status = os.waitpid(pid, 0)
    results[name] = os.waitstatus_to_exitcode(status)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probes(bwrap_works: None) -> dict[str, dict[str, int]]:
    """Probe results per profile, plus ``"none"``: the same probes without a filter."""
    results: dict[str, dict[str, int]] = {}
    for profile in (None, *PROFILES):
        proc = run_sandboxed([*PYTHON, PROBE], profile)
        assert proc.returncode == 0, proc.stderr
        results[profile or "none"] = json.loads(proc.stdout)
    return results


SIGSYS: Final = -signal.SIGSYS
# Where the profile leaves a call alone but the kernel's own answer depends on privileges and
# configuration (AF_PACKET needs CAP_NET_RAW, nfnetlink may be a module), expect whatever the
# unfiltered control run got.
UNFILTERED: Final = -1000
# probe -> (errno or -signal under baseline, under restricted)
EXPECTED: Final[dict[str, tuple[int, int]]] = {
    "unshare_user": (errno.EPERM, errno.EPERM),
    "unshare_net": (errno.EPERM, errno.EPERM),
    "unshare_files": (0, 0),
    "clone_newuser": (errno.EPERM, errno.EPERM),
    "clone_plain": (0, 0),
    "clone3": (errno.ENOSYS, errno.ENOSYS),
    "mount": (errno.EPERM, errno.EPERM),
    "ptrace_traceme": (errno.EPERM, errno.EPERM),
    "keyctl": (errno.EPERM, errno.EPERM),
    "bpf": (errno.EPERM, errno.EPERM),
    "perf_event_open": (errno.EPERM, errno.EPERM),
    "io_uring_setup": (errno.EPERM, errno.EPERM),
    "tiocsti": (errno.EPERM, errno.EPERM),
    "tiocsti_high_bits": (errno.EPERM, errno.EPERM),
    "tiocsti_bad_fd": (errno.EPERM, errno.EPERM),
    "tioclinux": (errno.EPERM, errno.EPERM),
    "tiocgwinsz": (0, 0),
    "personality_query": (0, 0),
    "personality_no_aslr": (errno.EPERM, errno.EPERM),
    "x32_getpid": (errno.EPERM, errno.EPERM),
    "int80_getpid": (SIGSYS, SIGSYS),
    "socket_unix": (0, 0),
    "socket_unix_high_bits": (0, 0),
    "socket_inet": (0, 0),
    "socket_inet6": (0, 0),
    "socket_packet": (UNFILTERED, errno.EPERM),
    "socket_packet_bad_type": (errno.EINVAL, errno.EPERM),
    "socket_packet_high_bits": (errno.EINVAL, errno.EPERM),
    "socket_netlink_route": (0, 0),
    "socket_netlink_netfilter": (UNFILTERED, errno.EPERM),
}
# Probes whose unfiltered answer is not EPERM/ENOSYS whatever the kernel configuration, so
# the control run proves the filter (not the kernel) produced the refusal.
CONTROLLED: Final = (
    "mount",  # ENOENT: path lookup precedes the capability check
    "keyctl",  # EOPNOTSUPP (or ENOSYS without CONFIG_KEYS)
    "perf_event_open",  # EFAULT: the attr is copied first
    "clone3",  # EINVAL: size 0
    "tiocsti_bad_fd",  # EBADF
    "tioclinux",  # ENOTTY: a pty is not a virtual console
    "personality_no_aslr",  # succeeds
    "socket_packet_bad_type",  # EINVAL
    "socket_packet_high_bits",  # EINVAL: the kernel truncates the family to AF_PACKET
    "unshare_user",  # a nested user namespace is allowed by default
    "clone_newuser",
    "ptrace_traceme",  # succeeds
    "tiocsti",  # succeeds on the controlling tty, or EIO when legacy_tiocsti is off
    "tiocsti_high_bits",  # likewise: the kernel drops the upper bits
    "x32_getpid",  # ENOSYS without CONFIG_X86_X32_ABI, else succeeds
    "int80_getpid",  # succeeds, or SIGSEGV without IA32 emulation; never SIGSYS
)


@pytest.mark.parametrize("probe", list(EXPECTED))
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.needs_bwrap
def test_syscall_probe(probes: dict[str, dict[str, int]], profile: Profile, probe: str) -> None:
    expected = EXPECTED[probe][PROFILES.index(profile)]
    if expected == UNFILTERED:
        expected = probes["none"][probe]
    assert probes[profile][probe] == expected, (
        f"{probe} under {profile}: got {probes[profile][probe]}, "
        f"without filter {probes['none'][probe]}"
    )


@pytest.mark.parametrize("probe", CONTROLLED)
@pytest.mark.needs_bwrap
def test_probe_control_without_filter(probes: dict[str, dict[str, int]], probe: str) -> None:
    refused = EXPECTED[probe][1]
    assert probes["none"][probe] != refused


@pytest.mark.needs_bwrap
def test_control_tiocsti_high_bits_reach_the_kernel(probes: dict[str, dict[str, int]]) -> None:
    """Without the filter, upper bits are dropped by the kernel: the call is plain TIOCSTI."""
    assert probes["none"]["tiocsti_high_bits"] == probes["none"]["tiocsti"]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.usefixtures("bwrap_works")
@pytest.mark.needs_bwrap
def test_shell_and_coreutils(profile: Profile) -> None:
    proc = run_sandboxed(["/bin/sh", "-c", "echo ok && ls / && cat /proc/self/status"], profile)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ok"
    assert {"usr", "bin", "proc"} <= set(lines)
    assert "Seccomp:\t2" in lines  # a filter really is installed


PYTHON_WORKLOAD: Final = r"""
import hashlib, os, subprocess, sys, threading
total = sum(i * i for i in range(100_000))
digests = []
threads = [threading.Thread(target=lambda: digests.append(hashlib.sha256(b"x").hexdigest()))
           for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
child = subprocess.run(["/bin/echo", "child"], capture_output=True, text=True, check=True)
pid = os.fork()
if pid == 0:
    os._exit(7)
_, status = os.waitpid(pid, 0)
print(total, len(digests), child.stdout.strip(), os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.usefixtures("bwrap_works")
@pytest.mark.needs_bwrap
def test_python_threads_and_children(profile: Profile) -> None:
    proc = run_sandboxed([*PYTHON, PYTHON_WORKLOAD], profile)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(sum(i * i for i in range(100_000))), "4", "child", "7"]


NODE_WORKLOAD: Final = r"""
const cp = require("child_process");
const os = require("os");
const out = cp.execFileSync("/bin/echo", ["child"]).toString().trim();
const ifaces = Object.keys(os.networkInterfaces());
require("fs").readFile("/etc/hostname", () => console.log(6 * 7, out, ifaces.includes("lo")));
"""


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.usefixtures("bwrap_works")
@pytest.mark.needs_bwrap
def test_node(profile: Profile) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    proc = run_sandboxed([node, "-e", NODE_WORKLOAD], profile)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42", "child", "true"]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.usefixtures("bwrap_works")
@pytest.mark.needs_bwrap
def test_git(profile: Profile) -> None:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    script = (
        f"{git} init -q /tmp/r && cd /tmp/r && echo hi > f && {git} add f && "
        f"{git} -c user.name=a -c user.email=a@example.com commit -q -m first && "
        f"{git} log --format=%s"
    )
    proc = run_sandboxed(["/bin/sh", "-c", script], profile, extra=["--tmpfs", "/tmp"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "first"


# ---------------------------------------------------------------------------------------------
# The OCI export (runc, crun) states the same rules as the compiled filter.


def run_oci(rules: dict[str, object], name: str, args: Sequence[int]) -> int:
    """The action of an OCI ``linux.seccomp`` object, as libseccomp applies it."""
    assert rules["defaultAction"] == "SCMP_ACT_ALLOW"
    syscalls = rules["syscalls"]
    assert isinstance(syscalls, list)
    for rule in syscalls:
        if name not in rule["names"]:
            continue
        conditions = rule.get("args", [])
        assert len({c["index"] for c in conditions}) == len(conditions)  # runc ORs repeats
        if all((args[c["index"]] & c["value"]) == c["valueTwo"] for c in conditions):
            assert rule["action"] == "SCMP_ACT_ERRNO"
            return 0x00050000 | int(rule["errnoRet"])
    return ALLOW


ARG_RULED = ("clone", "unshare", "ioctl", "personality", "socket")
INTERESTING_ARGS = st.one_of(
    st.integers(0, U64),
    st.sampled_from([0, 8, 16, 1, 2, 10, U32, seccomp.TIOCSTI, 1 << 32 | seccomp.TIOCSTI]),
    st.sampled_from([seccomp.CLONE_NEWUSER, seccomp.CLONE_NEWTIME, 0x11, 0x1200011]),
)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers are x86_64 ones")
@pytest.mark.parametrize("profile", PROFILES)
@given(
    name=st.sampled_from(ARG_RULED),
    args=st.lists(INTERESTING_ARGS, min_size=6, max_size=6),
)
def test_oci_export_decides_like_the_compiled_filter(
    profile: Profile, name: str, args: list[int]
) -> None:
    nr = seccomp._X86_64[name]
    expected = run_bpf(build_filter(profile), nr, args)
    assert run_oci(seccomp.oci_seccomp(profile), name, args) == expected


@pytest.mark.skipif(platform.machine() != "x86_64", reason="aarch64 lacks some of the names")
@pytest.mark.parametrize("profile", PROFILES)
def test_oci_export_refuses_the_same_syscalls_outright(profile: Profile) -> None:
    rules = seccomp.oci_seccomp(profile)
    for name in denied_syscalls(profile):
        want = ENOSYS if name in ENOSYS_SYSCALLS else EPERM
        assert run_oci(rules, name, [0] * 6) == want, name
    assert rules["architectures"] == ["SCMP_ARCH_X86_64"]


S_ISUID, S_ISGID, O_CREAT, O_TMPFILE = 0o4000, 0o2000, 0o100, 0o20000000 | 0o200000


@pytest.mark.parametrize("profile", PROFILES)
def test_no_setuid_or_setgid_bit_can_be_set(profile: Profile) -> None:
    """chmod-like calls with S_ISUID/S_ISGID, and creating calls with such a mode: EPERM;
    the same calls without those bits (or open without O_CREAT): allowed."""
    program = host_filter(profile)
    mode_arg = {"chmod": 1, "fchmod": 1, "creat": 1, "mknod": 1}
    mode_arg |= {"fchmodat": 2, "fchmodat2": 2, "mknodat": 2}
    for name, arg in mode_arg.items():
        for bit in (S_ISUID, S_ISGID):
            args = [0] * 6
            args[arg] = 0o755 | bit
            assert run_bpf(program, NR[name], args) == EPERM, (name, bit)
            assert run_oci(seccomp.oci_seccomp(profile), name, args) == EPERM, (name, bit)
        args = [0] * 6
        args[arg] = 0o755
        assert run_bpf(program, NR[name], args) == ALLOW, name
    for name, flags_arg in (("open", 1), ("openat", 2)):
        for flags in (O_CREAT, O_TMPFILE):
            args = [0] * 6
            args[flags_arg], args[flags_arg + 1] = flags, 0o4755
            assert run_bpf(program, NR[name], args) == EPERM, (name, flags)
            args[flags_arg + 1] = 0o755
            assert run_bpf(program, NR[name], args) == ALLOW, (name, flags)
        args = [0] * 6
        args[flags_arg + 1] = 0o4755  # no O_CREAT: the mode is ignored by the kernel
        assert run_bpf(program, NR[name], args) == ALLOW, name
