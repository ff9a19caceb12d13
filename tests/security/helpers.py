"""Shared tools of the attack suite: raw syscalls from inside a box, host-side checks."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import pytest

from corral import Sandbox

# x86_64 syscall numbers (asm/unistd_64.h). The suite probes raw numbers, so it runs on x86_64
# only; elsewhere the syscall attacks skip (the seccomp unit tests cover aarch64's table).
NR: dict[str, int] = {
    "setuid": 105,
    "setgid": 106,
    "setgroups": 116,
    "setresuid": 117,
    "setresgid": 119,
    "capset": 126,
    "mknod": 133,
    "personality": 135,
    "pivot_root": 155,
    "prctl": 157,
    "chroot": 161,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "reboot": 169,
    "sethostname": 170,
    "iopl": 172,
    "init_module": 175,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "open_tree": 428,
    "fsopen": 430,
    "pidfd_open": 434,
    "clone3": 435,
    "pidfd_getfd": 438,
    "ptrace": 101,
    "clone": 56,
    "syslog": 103,
    "getpid": 39,
}
X32_BIT = 0x40000000

PRELUDE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def _arg(x):
    if isinstance(x, int):
        return ctypes.c_long(x)
    if isinstance(x, bytes):
        return ctypes.c_char_p(x)
    return x
def sc(nr, *a):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[_arg(x) for x in a])
    e = ctypes.get_errno()
    return {"ret": r, "errno": errno.errorcode.get(e, str(e)) if r == -1 else None}
def err(fn, *a):
    try:
        fn(*a)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return None
def agent_pid():
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try:
                argv = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\0')
                if any(a.endswith(b'/agent.py') for a in argv) and b'bwrap' not in argv[0]:
                    return int(p)  # the agent (bwrap's pid 1 names it in its own argv)
            except OSError:
                pass
    return -1
"""


def root_is_copy_on_write(sb: Sandbox) -> bool:
    """The microVM's root is a copy-on-write overlay of the host's, in the VM's memory: a write
    outside the workspace succeeds there and never reaches the host (``host_guard`` checks the
    host's files after every attack). The other backends refuse it (read-only binds)."""
    return sb.policy.backend == "microvm"


def refused_or_kept_in_the_vm(sb: Sandbox, *refusals: str | None) -> set[str | None]:
    """The outcomes an attack on a host file may have: the refusals, and success on a
    copy-on-write root (the VM's copy changes; the host's does not)."""
    return set(refusals) | ({None} if root_is_copy_on_write(sb) else set())


def gvisor(sb: Sandbox) -> bool:
    """The box runs on gVisor's kernel (runsc): the same refusal may come with another errno,
    and host kernel interfaces (/proc knobs, host processes) are simply not there."""
    return sb.policy.runtime == "runsc"


def needs_x86_64() -> None:
    if platform.machine() not in ("x86_64", "amd64"):
        pytest.skip("raw syscall numbers of the attack suite are x86_64's")


async def box_py(sb: Sandbox, code: str, *, timeout: float = 20) -> Any:
    """Run ``code`` (which sets ``res``) in the box's python3; return ``res`` as JSON data."""
    program = PRELUDE + code + "\nprint(json.dumps(res))\n"
    r = await sb.run(["python3", "-c", program], timeout=timeout)
    lines = r.stdout.strip().splitlines()
    assert r.exit_code == 0 and lines, f"probe failed ({r.exit_code}): {r.stdout!r} {r.stderr!r}"
    return json.loads(lines[-1])


async def box_syscall(sb: Sandbox, name: str, *args: str | int) -> dict[str, Any]:
    """One raw syscall in the box: ``{"ret": r, "errno": "EPERM" | None}``."""
    needs_x86_64()
    rendered = ", ".join(a if isinstance(a, str) else str(a) for a in args)
    res: dict[str, Any] = await box_py(sb, f"res = sc({NR[name]}{', ' if args else ''}{rendered})")
    return res


def host_pids_mentioning(token: str) -> list[int]:
    """Host processes whose command line contains ``token`` (leaks after a close)."""
    found = []
    needle = token.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def read_host(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def to_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


async def rlimits_only(sb: Sandbox) -> bool:
    """A rootless box without a delegated cgroup: memory and pids are per-process rlimits
    (RLIMIT_AS, RLIMIT_NPROC), which refuse the allocation or the fork instead of an OOM kill
    or a pids.max event the host would report."""
    rootless = (await sb.info()).get("rootless")
    return isinstance(rootless, dict) and rootless.get("limits") == "rlimits"
