"""A small, pure-Python compiler of the seccomp filter corral hands to ``bwrap --seccomp FD``.

bwrap reads a raw array of classic-BPF ``struct sock_filter`` (``u16 code; u8 jt; u8 jf;
u32 k``, native byte order, no header) and installs it in the sandboxed process just before
``execve``. The filter sees a ``struct seccomp_data``::

    offset 0   u32 nr          syscall number
    offset 4   u32 arch        AUDIT_ARCH_* of the calling convention used
    offset 8   u64 instruction_pointer
    offset 16  u64 args[6]     every argument widened to 64 bits

Classic BPF only loads 32-bit words, so an argument is read as two halves; on little-endian
machines the low half of ``args[i]`` is at ``16 + 8*i``.

Layout of the generated program (the default action is ALLOW)::

        ld   [arch]
        jeq  #AUDIT_ARCH_<host>, +1        ; next instruction only for foreign arches
        ret  #KILL_PROCESS
        ld   [nr]
        jset #0x40000000, eperm            ; x86_64 only: the x32 ABI
        jeq  #mount, eperm                 ; one instruction per syscall refused outright
        ...
        jeq  #clone3, enosys
        jeq  #clone, block_clone           ; one instruction per syscall whose arguments matter
        ...
        ret  #ALLOW
 eperm: ret  #ERRNO|EPERM
enosys: ret  #ERRNO|ENOSYS
 block_clone:                              ; one self-contained block per such syscall,
        ld   [args[0] low]                 ; ending in its own returns, since BPF jumps
        jset #CLONE_NEW*, +0, +1           ; only go forward
        ret  #ERRNO|EPERM
        ret  #ALLOW
        ...

Every jump is forward and short: the dispatch chain has well under 255 entries, the shared
returns sit right after it, and the argument blocks only jump inside themselves. A tiny
assembler (:class:`_Assembler`) resolves labels and refuses to emit a jump that does not fit
the 8-bit ``jt``/``jf`` fields, so a future table that outgrows this layout fails loudly at
build time instead of producing a wrong filter.

Choices worth explaining:

* **Foreign architectures are killed.** On x86_64 a process can still enter the kernel with
  the i386 convention (``int 0x80``), where syscall numbers mean different things, so a
  filter written for x86_64 numbers would be meaningless there. Nothing corral runs needs
  it, so such a call kills the process (SIGSYS) rather than guessing.
* **x32 gets EPERM.** x32 syscalls arrive with ``AUDIT_ARCH_X86_64`` but with bit 30 set in
  ``nr``; most map onto the same handlers as x86_64 ones and would slip past the number
  checks, so any number with that bit is refused.
* **clone3 returns ENOSYS, not EPERM.** Its flags live in a ``struct clone_args`` in user
  memory, which seccomp cannot read, so namespace flags cannot be checked. ENOSYS makes
  glibc (and other runtimes) believe the kernel predates clone3 and fall back to ``clone``,
  whose flags are a register and *are* checked. EPERM would instead surface as a failure of
  every ``fork``/``pthread_create``. Docker and podman do the same.
* **Arguments are compared on their low 32 bits only.** ``ioctl``'s ``cmd``, ``unshare``'s
  and ``clone``'s flags (the kernel takes ``lower_32_bits``), ``personality``'s persona and
  ``socket``'s family and protocol are 32-bit in the kernel, which silently drops the upper
  half of the 64-bit register. Matching the full 64 bits would let ``ioctl(fd,
  0x1_0000_5412)`` miss the TIOCSTI rule while the kernel still runs TIOCSTI, so only the
  half the kernel looks at is compared.
* **clone and unshare** are refused (EPERM) when the flags ask for any new namespace: a
  nested user namespace hands its creator a full capability set over fresh kernel
  interfaces, which is the most common first step of a kernel exploit. ``CLONE_NEWTIME``
  sits inside ``CSIGNAL`` for ``clone`` (the exit-signal byte); no valid signal has that bit,
  so checking it there refuses nothing legitimate.
* **No setuid or setgid bit** on a file a command creates or changes: ``chmod``,
  ``fchmod``, ``fchmodat(2)``, ``mknod(at)`` and ``creat`` with ``S_ISUID``/``S_ISGID`` in
  the mode, and ``open``/``openat`` with ``O_CREAT`` or ``O_TMPFILE`` and such a mode, get
  EPERM. The workspace outlives the box and its files belong to the workspace owner on the
  host (root, when root owns it): a setuid binary a box left there would run as that owner
  for any local user. ``openat2`` keeps its mode in a struct seccomp cannot read, so it gets
  ENOSYS (as ``clone3``): programs fall back to ``openat`` (the guest agent walks the path
  with ``O_NOFOLLOW`` instead, :func:`corral.agent.files.open_beneath`).
* **personality** is allowed only for ``PER_LINUX`` (0), ``PER_LINUX32`` (8, as used by
  ``setarch``/``linux32``, it only changes ``uname``) and the ``0xffffffff`` query. Anything
  else is refused, notably ``ADDR_NO_RANDOMIZE`` (turns off ASLR for the next ``execve``)
  and ``READ_IMPLIES_EXEC``.
* **restricted / sockets**: ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` are allowed, and
  ``AF_NETLINK`` only with ``NETLINK_ROUTE`` (0). glibc's ``getifaddrs`` (used by Node's
  ``os.networkInterfaces()``, Python's ``socket.if_nameindex`` and ``ip addr``) and
  ``getaddrinfo(AI_ADDRCONFIG)`` need route netlink, and in a sandbox without capabilities
  it can only read. Every other netlink family (nf_tables through ``NETLINK_NETFILTER``,
  xfrm, audit, generic netlink, ...) and every other address family (``AF_PACKET``,
  ``AF_VSOCK``, ``AF_BLUETOOTH``, ...) is refused: those are large kernel surfaces no
  agent tool needs.

Names in the policy that do not exist on an architecture (``iopl`` on aarch64, say) are
skipped for that architecture; each table lists those names explicitly so that a typo
cannot silently drop a rule.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, get_args

from corral.errors import BackendUnavailable, PolicyError, SandboxError

__all__ = ["Profile", "build_filter", "denied_syscalls", "oci_seccomp"]

Profile: TypeAlias = Literal["baseline", "restricted"]
_PROFILES: Final[tuple[str, ...]] = get_args(Profile)

# ---------------------------------------------------------------------------------------------
# Kernel constants (include/uapi/linux/{filter,bpf_common,seccomp,audit}.h).

_BPF_LD_W_ABS: Final = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K: Final = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_JSET_K: Final = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
_BPF_RET_K: Final = 0x06 | 0x00  # BPF_RET | BPF_K

_RET_KILL_PROCESS: Final = 0x80000000
_RET_ERRNO: Final = 0x00050000
_RET_ALLOW: Final = 0x7FFF0000

ALLOW: Final = _RET_ALLOW
EPERM: Final = _RET_ERRNO | errno.EPERM
ENOSYS: Final = _RET_ERRNO | errno.ENOSYS
KILL_PROCESS: Final = _RET_KILL_PROCESS

_AUDIT_ARCH_X86_64: Final = 0xC000003E  # EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
_AUDIT_ARCH_AARCH64: Final = 0xC00000B7  # EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
_X32_SYSCALL_BIT: Final = 0x40000000

_BPF_MAXINSNS: Final = 4096  # the kernel refuses longer programs
_SOCK_FILTER: Final = struct.Struct("=HBBI")  # native order, exactly 8 bytes

# seccomp_data offsets.
_OFF_NR: Final = 0
_OFF_ARCH: Final = 4
_OFF_ARGS: Final = 16

CLONE_NEWTIME: Final = 0x00000080
CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
CLONE_NEWNET: Final = 0x40000000
_NAMESPACE_FLAGS: Final = (
    CLONE_NEWNS
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWIPC
    | CLONE_NEWUTS
    | CLONE_NEWCGROUP
    | CLONE_NEWTIME
)

TIOCSTI: Final = 0x5412  # push a byte into a terminal's input queue: types into the host shell
TIOCLINUX: Final = 0x541C  # virtual-console tricks, including selection paste (same risk)

PER_LINUX: Final = 0x0000
PER_LINUX32: Final = 0x0008
PERSONALITY_QUERY: Final = 0xFFFFFFFF

AF_UNIX: Final = 1
AF_INET: Final = 2
AF_INET6: Final = 10
AF_NETLINK: Final = 16
NETLINK_ROUTE: Final = 0

# ---------------------------------------------------------------------------------------------
# Syscall tables (name -> number). x86_64 numbers are checked against
# /usr/include/x86_64-linux-gnu/asm/unistd_64.h, aarch64 ones against
# /usr/include/asm-generic/unistd.h (aarch64 uses the generic table). Only the syscalls the
# policy mentions are listed.

# Since Linux 5.1 (number 424 on), new syscalls get the same number on every architecture.
_UNIFIED: Final[Mapping[str, int]] = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
}

_X86_64: Final[Mapping[str, int]] = {
    "open": 2,
    "creat": 85,
    "chmod": 90,
    "fchmod": 91,
    "mknod": 133,
    "openat": 257,
    "mknodat": 259,
    "fchmodat": 268,
    "openat2": 437,
    "fchmodat2": 452,
    "ioctl": 16,
    "socket": 41,
    "clone": 56,
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "personality": 135,
    "ustat": 136,
    "sysfs": 139,
    "vhangup": 153,
    "modify_ldt": 154,
    "pivot_root": 155,
    "_sysctl": 156,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "migrate_pages": 256,
    "unshare": 272,
    "move_pages": 279,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    **_UNIFIED,
}

_AARCH64: Final[Mapping[str, int]] = {
    "mknodat": 33,
    "fchmod": 52,
    "fchmodat": 53,
    "openat": 56,
    "openat2": 437,
    "fchmodat2": 452,
    "lookup_dcookie": 18,
    "ioctl": 29,
    "umount2": 39,
    "mount": 40,
    "pivot_root": 41,
    "nfsservctl": 42,
    "chroot": 51,
    "vhangup": 58,
    "quotactl": 60,
    "acct": 89,
    "personality": 92,
    "unshare": 97,
    "kexec_load": 104,
    "init_module": 105,
    "delete_module": 106,
    "clock_settime": 112,
    "syslog": 116,
    "ptrace": 117,
    "reboot": 142,
    "sethostname": 161,
    "setdomainname": 162,
    "settimeofday": 170,
    "adjtimex": 171,
    "socket": 198,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "clone": 220,
    "swapon": 224,
    "swapoff": 225,
    "migrate_pages": 238,
    "move_pages": 239,
    "perf_event_open": 241,
    "fanotify_init": 262,
    "name_to_handle_at": 264,
    "open_by_handle_at": 265,
    "clock_adjtime": 266,
    "setns": 268,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "kcmp": 272,
    "finit_module": 273,
    "userfaultfd": 282,
    "bpf": 280,
    "kexec_file_load": 294,
    **_UNIFIED,
}


@dataclass(frozen=True)
class _Arch:
    """One architecture's audit number and syscall table."""

    name: str
    audit_arch: int
    table: Mapping[str, int]
    #: Policy names with no syscall on this architecture (skipped, not an error).
    absent: frozenset[str]
    #: Refuse syscall numbers with the x32 bit (x86_64 only).
    x32_bit: bool


_ARCHES: Final[Mapping[str, _Arch]] = {
    "x86_64": _Arch("x86_64", _AUDIT_ARCH_X86_64, _X86_64, frozenset(), x32_bit=True),
    "aarch64": _Arch(
        "aarch64",
        _AUDIT_ARCH_AARCH64,
        _AARCH64,
        frozenset(
            {"uselib", "iopl", "ioperm", "modify_ldt", "sysfs", "ustat", "_sysctl"}
            | {"open", "creat", "chmod", "mknod"}
        ),
        x32_bit=False,
    ),
}
_MACHINE_ALIASES: Final[Mapping[str, str]] = {"amd64": "x86_64", "arm64": "aarch64"}

# ---------------------------------------------------------------------------------------------
# The policy, as data.


@dataclass(frozen=True)
class _AnyBit:
    """Holds when the low word of ``args[arg]`` shares a bit with ``mask``."""

    arg: int
    mask: int


@dataclass(frozen=True)
class _OneOf:
    """Holds when the low word of ``args[arg]`` is one of ``values``."""

    arg: int
    values: tuple[int, ...]


@dataclass(frozen=True)
class _NoneOf:
    """Holds when the low word of ``args[arg]`` is none of ``values``."""

    arg: int
    values: tuple[int, ...]


_Predicate: TypeAlias = _AnyBit | _OneOf | _NoneOf


@dataclass(frozen=True)
class _Rule:
    """Return ``action`` when every predicate holds; otherwise try the next rule."""

    when: tuple[_Predicate, ...]
    action: int = EPERM


# Refused whatever the arguments, in every profile: mount and namespace plumbing, tracing and
# cross-process memory access, kernel keyrings, eBPF, perf, io_uring (its own syscall-less
# path around this filter), modules and kexec, host clock/power/swap/accounting, raw handle
# access (open_by_handle_at escapes bind mounts), userfaultfd (a favourite exploit helper),
# raw port I/O and fd theft from other processes.
_BASELINE_DENY: Final[frozenset[str]] = frozenset(
    {
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "keyctl",
        "add_key",
        "request_key",
        "bpf",
        "perf_event_open",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "init_module",
        "finit_module",
        "delete_module",
        "kexec_load",
        "kexec_file_load",
        "reboot",
        "swapon",
        "swapoff",
        "setns",
        "open_tree",
        "move_mount",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
        "open_by_handle_at",
        "name_to_handle_at",
        "userfaultfd",
        "acct",
        "quotactl",
        "quotactl_fd",
        "lookup_dcookie",
        "syslog",
        "settimeofday",
        "clock_settime",
        "clock_adjtime",
        "adjtimex",
        "uselib",
        "vhangup",
        "iopl",
        "ioperm",
        "fanotify_init",
        "nfsservctl",
        "pidfd_getfd",
        "kcmp",
    }
)

# restricted adds: other-process memory hints and page migration, the x86 LDT (old exploit
# surface, only Wine and DOS emulators use it), obsolete filesystem-info calls, and renaming
# the (already private) UTS namespace. None of these is used by shells, interpreters or git.
_RESTRICTED_EXTRA_DENY: Final[frozenset[str]] = frozenset(
    {
        "process_madvise",
        "migrate_pages",
        "move_pages",
        "modify_ldt",
        "sysfs",
        "ustat",
        "_sysctl",
        "sethostname",
        "setdomainname",
    }
)

_ENOSYS: Final[frozenset[str]] = frozenset({"clone3", "openat2"})

# No setuid/setgid bit on any file a command makes or changes: the workspace outlives the box
# and its files are the workspace owner's on the host (root's, when root owns it), so a
# setuid binary left there would run as that owner for any local user who runs it.
_SET_ID: Final = 0o6000  # S_ISUID | S_ISGID
_O_CREAT: Final = 0o100  # the same on x86_64 and aarch64
_O_TMPFILE: Final = 0o20000000  # __O_TMPFILE (its mode is the new file's too)
_SET_ID_RULES: Final[Mapping[str, tuple[_Rule, ...]]] = {
    "chmod": (_Rule((_AnyBit(1, _SET_ID),)),),
    "fchmod": (_Rule((_AnyBit(1, _SET_ID),)),),
    "fchmodat": (_Rule((_AnyBit(2, _SET_ID),)),),
    "fchmodat2": (_Rule((_AnyBit(2, _SET_ID),)),),
    "creat": (_Rule((_AnyBit(1, _SET_ID),)),),
    "open": (_Rule((_AnyBit(1, _O_CREAT | _O_TMPFILE), _AnyBit(2, _SET_ID))),),
    "openat": (_Rule((_AnyBit(2, _O_CREAT | _O_TMPFILE), _AnyBit(3, _SET_ID))),),
    "mknod": (_Rule((_AnyBit(1, _SET_ID),)),),
    "mknodat": (_Rule((_AnyBit(2, _SET_ID),)),),
}

_BASELINE_ARG_RULES: Final[Mapping[str, tuple[_Rule, ...]]] = {
    **_SET_ID_RULES,
    # x86_64 and aarch64 both pass clone's flags in args[0].
    "clone": (_Rule((_AnyBit(0, _NAMESPACE_FLAGS),)),),
    "unshare": (_Rule((_AnyBit(0, _NAMESPACE_FLAGS),)),),
    "ioctl": (_Rule((_OneOf(1, (TIOCSTI, TIOCLINUX)),)),),
    "personality": (_Rule((_NoneOf(0, (PER_LINUX, PER_LINUX32, PERSONALITY_QUERY)),)),),
}

_RESTRICTED_EXTRA_ARG_RULES: Final[Mapping[str, tuple[_Rule, ...]]] = {
    "socket": (
        _Rule((_NoneOf(0, (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)),)),
        _Rule((_OneOf(0, (AF_NETLINK,)), _NoneOf(2, (NETLINK_ROUTE,)))),
    ),
}


def _policy(profile: str) -> tuple[frozenset[str], Mapping[str, tuple[_Rule, ...]]]:
    """The outright-denied names (EPERM) and the argument rules of ``profile``."""
    if profile == "baseline":
        return _BASELINE_DENY, _BASELINE_ARG_RULES
    if profile == "restricted":
        return (
            _BASELINE_DENY | _RESTRICTED_EXTRA_DENY,
            {**_BASELINE_ARG_RULES, **_RESTRICTED_EXTRA_ARG_RULES},
        )
    raise PolicyError(
        f"unknown seccomp profile {profile!r}; expected one of: {', '.join(_PROFILES)}"
    )


# ---------------------------------------------------------------------------------------------
# The assembler.


@dataclass(frozen=True)
class _Insn:
    """One BPF instruction, its jumps still labels."""

    code: int
    jt: str | None  # label, or None for "the next instruction"
    jf: str | None
    k: int


class _Assembler:
    """Collects instructions with symbolic forward jumps, then resolves them to bytes."""

    def __init__(self) -> None:
        self._insns: list[_Insn] = []
        self._labels: dict[str, int] = {}
        self._fresh = 0

    def fresh_label(self, hint: str) -> str:
        """A label name no other call returns (for blocks generated in loops)."""
        self._fresh += 1
        return f"{hint}#{self._fresh}"

    def label(self, name: str) -> None:
        if name in self._labels:
            raise SandboxError(f"seccomp assembler: label {name!r} defined twice")
        self._labels[name] = len(self._insns)

    def load(self, offset: int) -> None:
        """``A = *(u32 *)(seccomp_data + offset)``."""
        self._insns.append(_Insn(_BPF_LD_W_ABS, None, None, offset))

    def load_arg_low(self, arg: int) -> None:
        """Load the half of ``args[arg]`` the kernel keeps when it truncates to 32 bits."""
        if not 0 <= arg < 6:
            raise SandboxError(f"seccomp assembler: no syscall argument {arg}")
        low_half = 0 if sys.byteorder == "little" else 4
        self.load(_OFF_ARGS + 8 * arg + low_half)

    def jeq(self, k: int, jt: str | None = None, jf: str | None = None) -> None:
        self._insns.append(_Insn(_BPF_JEQ_K, jt, jf, k))

    def jset(self, k: int, jt: str | None = None, jf: str | None = None) -> None:
        self._insns.append(_Insn(_BPF_JSET_K, jt, jf, k))

    def ret(self, action: int) -> None:
        self._insns.append(_Insn(_BPF_RET_K, None, None, action))

    def _offset(self, pc: int, target: str | None) -> int:
        if target is None:
            return 0
        if target not in self._labels:
            raise SandboxError(f"seccomp assembler: undefined label {target!r}")
        offset = self._labels[target] - pc - 1
        # Classic BPF jumps are relative, forward-only and 8 bits wide.
        if not 0 <= offset <= 255:
            raise SandboxError(
                f"seccomp assembler: jump from {pc} to {target!r} is {offset} instructions; "
                "the filter layout must keep jumps forward and within 255"
            )
        return offset

    def assemble(self) -> bytes:
        if not self._insns or self._insns[-1].code != _BPF_RET_K:
            raise SandboxError("seccomp assembler: the program must end with a return")
        if len(self._insns) > _BPF_MAXINSNS:
            raise SandboxError(
                f"seccomp assembler: {len(self._insns)} instructions exceed {_BPF_MAXINSNS}"
            )
        out = bytearray()
        for pc, insn in enumerate(self._insns):
            jt, jf = self._offset(pc, insn.jt), self._offset(pc, insn.jf)
            out += _SOCK_FILTER.pack(insn.code, jt, jf, insn.k & 0xFFFFFFFF)
        return bytes(out)


def _emit_predicate(asm: _Assembler, pred: _Predicate, fail: str) -> None:
    """Fall through when ``pred`` holds, jump to ``fail`` when it does not."""
    asm.load_arg_low(pred.arg)
    if isinstance(pred, _AnyBit):
        asm.jset(pred.mask, jf=fail)
    elif isinstance(pred, _OneOf):
        matched = asm.fresh_label("matched")
        *head, last = pred.values
        for value in head:
            asm.jeq(value, jt=matched)
        asm.jeq(last, jf=fail)
        asm.label(matched)
    else:
        for value in pred.values:
            asm.jeq(value, jt=fail)


def _emit_rules(asm: _Assembler, rules: Iterable[_Rule]) -> None:
    """A self-contained block: the first rule whose predicates all hold decides."""
    for rule in rules:
        next_rule = asm.fresh_label("next_rule")
        for pred in rule.when:
            _emit_predicate(asm, pred, next_rule)
        asm.ret(rule.action)
        asm.label(next_rule)
    asm.ret(ALLOW)


def _numbers(arch: _Arch, names: Iterable[str]) -> list[tuple[str, int]]:
    """``(name, nr)`` sorted by number, skipping names the architecture does not have."""
    found: list[tuple[str, int]] = []
    for name in names:
        if name in arch.table:
            found.append((name, arch.table[name]))
        elif name not in arch.absent:
            # A name neither in the table nor declared absent is a typo or a missing entry;
            # skipping it silently would drop a rule.
            raise SandboxError(f"seccomp: no {arch.name} syscall number for {name!r}")
    return sorted(found, key=lambda item: item[1])


@functools.cache
def _compile(profile: str, arch_name: str) -> bytes:
    arch = _ARCHES[arch_name]
    deny, arg_rules = _policy(profile)

    asm = _Assembler()
    asm.load(_OFF_ARCH)
    asm.jeq(arch.audit_arch, jt="native")
    asm.ret(KILL_PROCESS)
    asm.label("native")
    asm.load(_OFF_NR)
    if arch.x32_bit:
        asm.jset(_X32_SYSCALL_BIT, jt="eperm")
    for _name, nr in _numbers(arch, deny):
        asm.jeq(nr, jt="eperm")
    for _name, nr in _numbers(arch, _ENOSYS):
        asm.jeq(nr, jt="enosys")
    blocks = _numbers(arch, arg_rules)
    for name, nr in blocks:
        asm.jeq(nr, jt=f"block:{name}")
    asm.ret(ALLOW)
    asm.label("eperm")
    asm.ret(EPERM)
    asm.label("enosys")
    asm.ret(ENOSYS)
    for name, _nr in blocks:
        asm.label(f"block:{name}")
        _emit_rules(asm, arg_rules[name])
    return asm.assemble()


def _host_arch() -> str:
    machine = platform.machine().lower()
    machine = _MACHINE_ALIASES.get(machine, machine)
    if machine not in _ARCHES:
        raise BackendUnavailable(
            f"corral's seccomp filter has no syscall table for the {machine or 'unknown'} "
            f"architecture (supported: {', '.join(_ARCHES)})"
        )
    return machine


def build_filter(profile: Profile = "baseline") -> bytes:
    """The seccomp program for ``profile`` on this machine, ready for ``bwrap --seccomp FD``.

    The result is a raw array of 8-byte ``struct sock_filter`` in native byte order and is
    computed once per profile (it is asked for on every sandbox start).

    Raises :class:`PolicyError` for an unknown profile and :class:`BackendUnavailable` on an
    architecture without a syscall table (only x86_64 and aarch64 have one).
    """
    _policy(profile)  # validate before touching the cache: errors are not cached
    return _compile(profile, _host_arch())


def denied_syscalls(profile: Profile = "baseline") -> frozenset[str]:
    """Names of the syscalls ``profile`` refuses whatever their arguments.

    These fail with EPERM, except ``clone3`` which fails with ENOSYS so that libc falls back
    to ``clone``. Not included, because they are refused only for some arguments: ``clone``
    and ``unshare`` (new namespaces), ``ioctl`` (TIOCSTI, TIOCLINUX), ``personality`` (all
    but 0, 8 and the query) and, in ``restricted``, ``socket`` (families other than UNIX,
    INET, INET6 and route netlink). Names are architecture-independent; those an
    architecture lacks are simply not compiled in there.
    """
    deny, _rules = _policy(profile)
    return deny | _ENOSYS


# ---------------------------------------------------------------------------------------------
# The same rules in the OCI runtime-spec format (``linux.seccomp``), for runc and crun.

_OCI_ARCHES: Final[Mapping[str, str]] = {
    "x86_64": "SCMP_ARCH_X86_64",
    "aarch64": "SCMP_ARCH_AARCH64",
}
_LOW_WORD: Final = 0xFFFFFFFF


def _complement_blocks(values: Iterable[int], bits: int = 32) -> list[tuple[int, int]]:
    """``(mask, value)`` prefix blocks covering every ``bits``-bit number not in ``values``.

    A set's complement is a union of at most ``bits * len(values)`` aligned blocks (as a
    CIDR list excludes addresses), and each block is one ``MASKED_EQ`` test.
    """
    excluded = sorted(set(values))
    out: list[tuple[int, int]] = []

    def walk(prefix: int, length: int, inside: list[int]) -> None:
        if not inside:
            mask = (_LOW_WORD << (bits - length)) & ((1 << bits) - 1)
            out.append((mask, prefix << (bits - length)))
        elif length < bits:
            shift = bits - length - 1
            for bit in (0, 1):
                child = prefix * 2 + bit
                walk(child, length + 1, [v for v in inside if v >> shift == child])

    walk(0, 0, excluded)
    return out


def _oci_conditions(pred: _Predicate) -> list[dict[str, Any]]:
    """Alternatives (any one holds) that together mean ``pred``, each one OCI condition."""
    if isinstance(pred, _AnyBit):
        blocks = [(1 << i, 1 << i) for i in range(32) if pred.mask >> i & 1]
    elif isinstance(pred, _OneOf):
        blocks = [(_LOW_WORD, value) for value in pred.values]
    else:
        blocks = _complement_blocks(pred.values)
    # Masks stay within the low word: the high half of the register is ignored, as the
    # compiled filter and the kernel do.
    return [
        {"index": pred.arg, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}
        for mask, value in blocks
    ]


def _oci_rules(name: str, rules: Iterable[_Rule]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rule in rules:
        if rule.action != EPERM:
            raise SandboxError(f"seccomp: the OCI export only knows EPERM rules ({name})")
        # One OCI rule per combination: conditions of one rule are ANDed, but no rule names
        # an argument twice, since runc ORs such conditions while crun ANDs them.
        combos: list[list[dict[str, Any]]] = [[]]
        for pred in rule.when:
            combos = [[*c, cond] for c in combos for cond in _oci_conditions(pred)]
        out += [{**_oci_errno([name], errno.EPERM), "args": args} for args in combos]
    return out


def _oci_errno(names: list[str], err: int) -> dict[str, Any]:
    return {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": err}


def oci_seccomp(profile: Profile = "baseline") -> dict[str, Any]:
    """``profile`` as an OCI ``linux.seccomp`` object: the rules of :func:`build_filter`.

    Only the form differs. Syscalls of another architecture (i386 via ``int 0x80``, x32)
    meet libseccomp's bad-architecture action instead of the compiled filter's kill, since
    only the native one is listed. Argument tests become ``SCMP_CMP_MASKED_EQ`` on the low
    32 bits: a bit set test is one rule per bit, "one of" one rule per value, and "none
    of" the complement as aligned blocks (see :func:`_complement_blocks`).
    """
    deny, arg_rules = _policy(profile)
    arch = _ARCHES[_host_arch()]
    syscalls: list[dict[str, Any]] = [
        _oci_errno([n for n, _ in _numbers(arch, deny)], errno.EPERM),
        _oci_errno([n for n, _ in _numbers(arch, _ENOSYS)], errno.ENOSYS),
    ]
    for name, _nr in _numbers(arch, arg_rules):
        syscalls += _oci_rules(name, arg_rules[name])
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": [_OCI_ARCHES[arch.name]],
        "syscalls": syscalls,
    }
