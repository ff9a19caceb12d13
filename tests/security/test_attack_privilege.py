"""Privilege escalation: setuid, capabilities, user namespaces, kernel keyrings, eBPF, perf,
io_uring, ptrace and memory access to the guest agent, its fds, module loading and more.

Every syscall is made raw (ctypes) so the test sees its errno: success would return >= 0.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ONE_ID, one_id_skip
from corral import Sandbox
from corral.policy import RlimitName
from security.helpers import (
    NR,
    PRELUDE,
    X32_BIT,
    box_py,
    box_syscall,
    gvisor,
    needs_x86_64,
    root_is_copy_on_write,
)

pytestmark = [
    pytest.mark.attack("privilege"),
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86_64 syscall numbers"),
]

DENIED = {"ret": -1, "errno": "EPERM"}


@one_id_skip("they are box root already: setuid(0) changes nothing")
async def test_setuid_to_root(sandbox: Sandbox) -> None:
    res = [
        await box_syscall(sandbox, "setuid", 0),
        await box_syscall(sandbox, "setresuid", 0, 0, 0),
        await box_syscall(sandbox, "setresgid", 0, 0, 0),
    ]
    assert res == [DENIED] * 3


async def test_setgroups_to_root_group(sandbox: Sandbox) -> None:
    res = await box_py(sandbox, "g = (ctypes.c_uint * 1)(0)\nres = sc(116, 1, g)")
    assert res == DENIED


async def test_setuid_binary_grants_nothing(sandbox: Sandbox) -> None:
    """su is setuid root on the host: no_new_privs and nosuid mounts make it inert."""
    r = await sandbox.run("su -c 'id -u' root </dev/null; grep NoNewPrivs /proc/self/status")
    if gvisor(sandbox):
        # gVisor's /proc/self/status has no NoNewPrivs line and it takes no nosuid option on
        # binds: no_new_privs alone keeps su inert (asked with prctl), and su is not even
        # root's there (host root is unmapped in the box's user namespace).
        assert r.stdout.strip() != "0"
        assert await box_syscall(sandbox, "prctl", 39, 0, 0, 0, 0) == {"ret": 1, "errno": None}
        return
    assert "NoNewPrivs:\t1" in r.stdout
    assert r.stdout.splitlines()[0] != "0"
    mounts = (await sandbox.run(["cat", "/proc/self/mounts"])).stdout
    # /usr is its own nosuid bind on the namespace backends; in the VM the whole root is one
    # nosuid overlay.
    where = "/" if root_is_copy_on_write(sandbox) else "/usr"
    usr = [ln for ln in mounts.splitlines() if ln.split()[1] == where]
    assert usr and "nosuid" in usr[-1].split()[3]


async def test_raise_capabilities_with_capset(sandbox: Sandbox) -> None:
    code = (
        "hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
        "data = (ctypes.c_uint32 * 6)(0xffffffff, 0xffffffff, 0, 0xffffffff, 0xffffffff, 0)\n"
        "res = sc(126, hdr, data)"
    )
    assert await box_py(sandbox, code) == DENIED


async def test_raise_ambient_capability(sandbox: Sandbox) -> None:
    # prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_SETUID): the cap is in no set of ours.
    res = await box_syscall(sandbox, "prctl", 47, 2, 7, 0, 0)
    assert res == DENIED or (gvisor(sandbox) and res == {"ret": -1, "errno": "EINVAL"})


async def test_file_capabilities_cannot_be_set(sandbox: Sandbox) -> None:
    code = (
        "open('/tmp/prog', 'w').close()\n"
        "cap = bytes.fromhex('01000002ffffffff00000000ffffffff00000000')\n"
        "res = err(os.setxattr, '/tmp/prog', 'security.capability', cap)"
    )
    # gVisor's tmpfs keeps no security.* attributes at all.
    assert await box_py(sandbox, code) in ({"EPERM", "ENOTSUP"} if gvisor(sandbox) else {"EPERM"})


async def test_new_user_namespace_with_unshare(sandbox: Sandbox) -> None:
    assert await box_syscall(sandbox, "unshare", 0x10000000) == DENIED  # CLONE_NEWUSER
    r = await sandbox.run("unshare -r id -u")
    assert r.exit_code != 0 and "Operation not permitted" in r.stderr


async def test_new_namespaces_with_clone(sandbox: Sandbox) -> None:
    # clone(CLONE_NEWUSER|CLONE_NEWNS|SIGCHLD, 0, ...): the flags are in a register.
    res = await box_syscall(sandbox, "clone", 0x10020011, 0, 0, 0, 0)
    assert res == DENIED
    # clone3 hides its flags in memory seccomp cannot read: it must not exist at all.
    code = "args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17)\nres = sc(435, args, 88)"
    assert await box_py(sandbox, code) == {"ret": -1, "errno": "ENOSYS"}


async def test_join_the_agents_namespaces_with_setns(sandbox: Sandbox) -> None:
    # gVisor's /proc has no ns files: any fd will do, the filter refuses setns itself.
    ns = "/proc/self/ns/mnt"
    code = (
        f"fd = os.open({ns!r}, os.O_RDONLY) if os.path.exists({ns!r}) else 0\nres = sc(308, fd, 0)"
    )
    assert await box_py(sandbox, code) == DENIED


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("keyctl", (0, -3, 1)),  # KEYCTL_GET_KEYRING_ID(session keyring, create)
        ("add_key", ("b'user'", "b'corral'", "b'secret'", 6, -3)),
        ("request_key", ("b'user'", "b'corral'", 0, -3)),
    ],
)
async def test_kernel_keyrings(sandbox: Sandbox, name: str, args: tuple[str | int, ...]) -> None:
    assert await box_syscall(sandbox, name, *args) == DENIED


async def test_load_an_ebpf_program(sandbox: Sandbox) -> None:
    code = (
        "insns = (ctypes.c_uint64 * 2)(0xb7, 0x95)\n"  # r0 = 0; exit
        "lic = ctypes.create_string_buffer(b'GPL')\n"
        "attr = (ctypes.c_uint64 * 16)()\n"
        "attr[0] = 1 | (2 << 32)\n"  # BPF_PROG_TYPE_SOCKET_FILTER, 2 insns
        "attr[1] = ctypes.addressof(insns)\n"
        "attr[2] = ctypes.addressof(lic)\n"
        "res = sc(321, 5, attr, 128)"  # BPF_PROG_LOAD
    )
    assert await box_py(sandbox, code) == DENIED


async def test_perf_event_open(sandbox: Sandbox) -> None:
    code = (
        "attr = (ctypes.c_uint32 * 32)()\n"
        "attr[0] = 1\nattr[1] = 128\n"  # PERF_TYPE_SOFTWARE, size
        "res = sc(298, attr, 0, -1, -1, 0)"
    )
    assert await box_py(sandbox, code) == DENIED


async def test_io_uring_setup(sandbox: Sandbox) -> None:
    code = "params = (ctypes.c_uint8 * 120)()\nres = sc(425, 8, params)"
    assert await box_py(sandbox, code) == DENIED


async def test_ptrace_the_guest_agent(sandbox: Sandbox) -> None:
    code = (
        "pid = agent_pid()\nassert pid > 0\n"
        "res = [sc(101, 16, pid, 0, 0), sc(101, 0x4206, pid, 0, 0)]"
    )
    assert await box_py(sandbox, code) == [DENIED, DENIED]  # PTRACE_ATTACH, PTRACE_SEIZE


async def test_read_the_agents_memory(sandbox: Sandbox) -> None:
    code = (
        "pid = agent_pid()\n"
        "buf = ctypes.create_string_buffer(64)\n"
        "local = (ctypes.c_uint64 * 2)(ctypes.addressof(buf), 64)\n"
        "remote = (ctypes.c_uint64 * 2)(0x400000, 64)\n"
        "res = [sc(310, pid, local, 1, remote, 1, 0),"
        " err(lambda: open(f'/proc/{pid}/mem', 'rb').read(1))]"
    )
    assert await box_py(sandbox, code) == [DENIED, "EACCES"]


async def test_read_the_agents_fds_and_environment(sandbox: Sandbox) -> None:
    code = (
        "pid = agent_pid()\n"
        "res = [err(os.listdir, f'/proc/{pid}/fd'), err(os.open, f'/proc/{pid}/fd/0', 0),"
        " err(lambda: open(f'/proc/{pid}/environ', 'rb').read())]"
    )
    res = await box_py(sandbox, code)
    if gvisor(sandbox) and res != ["EACCES"] * 3:
        pytest.xfail(
            "gVisor (2022) skips the ptrace access check on /proc/<pid>/fd and environ: a "
            f"command lists the agent's fds and reads its environment ({res}); the channel "
            "socket cannot be opened"
        )
    # One id: the agent (not dumpable) is owned by the commands' id, so they list its fd
    # numbers; opening one, or its environ, still needs CAP_SYS_PTRACE.
    assert res == [None if ONE_ID else "EACCES", "EACCES", "EACCES"]


async def test_steal_the_agents_channel_fd_with_pidfd_getfd(sandbox: Sandbox) -> None:
    code = (
        "pid = agent_pid()\n"
        "pfd = sc(434, pid, 0)['ret']\n"
        "res = [sc(438, pfd, fd, 0) for fd in range(3, 12)]"
    )
    assert await box_py(sandbox, code) == [DENIED] * 9


@one_id_skip("they hold its ids, but no capability")
@pytest.mark.parametrize("how", ["plain", "pty", "rlimits"])
async def test_commands_hold_none_of_the_agents_ids(sandbox: Sandbox, how: str) -> None:
    """However it is started (plain, on a terminal, with rlimits), a command holds no root
    id, saved ones included, and no capability (the agent's ambient and inheritable ones are
    emptied): it could never take box root back."""
    script = "grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapAmb):' /proc/self/status"
    pty = how == "pty"
    rlimits: dict[RlimitName, int] | None = {"nproc": 200} if how == "rlimits" else None
    proc = await sandbox.spawn(["sh", "-c", script], pty=pty, rlimits=rlimits)
    assert (await proc.wait(timeout=30)).exit_code == 0
    status = dict(
        line.split(":", 1) for line in proc.output().replace("\r", "").splitlines() if ":" in line
    )
    ids = {k: set(status[k].split()) for k in ("Uid", "Gid")}
    assert len(ids["Uid"]) == 1 and len(ids["Gid"]) == 1, status  # real = eff = saved = fs
    assert ids["Uid"] != {"0"} and ids["Gid"] != {"0"}, status
    assert "0" not in status["Groups"].split(), status
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        if caps == "CapAmb" and gvisor(sandbox):
            continue  # gVisor's /proc/PID/status has no CapAmb line
        assert int(status[caps], 16) == 0, (caps, status)
    assert await box_syscall(sandbox, "setresuid", 0, 0, 0) == DENIED


SIGNAL_AGENT = """
import os, sys
pid = int(sys.argv[1])
hits = 0
for _ in range(200000):
    try:
        os.kill(pid, 0)
        hits += 1
    except PermissionError:
        pass
print(hits)
"""


@one_id_skip("they can signal the agent, which ends their own box")
async def test_a_command_cannot_signal_the_agent_while_others_start(sandbox: Sandbox) -> None:
    """A command that tries, over and over, to signal the agent while the agent starts
    other commands never succeeds: the agent never holds the command user's real id, not
    even for a moment (a vfork from those ids would open that moment)."""
    agent = (await sandbox.info())["agent_pid"]
    prober = await sandbox.spawn(["python3", "-c", SIGNAL_AGENT, str(agent)])
    while prober.exit_code is None:  # spawn while it probes (bounded by its 200000 tries)
        await sandbox.run(["true"])
    assert (await prober.wait(timeout=60)).exit_code == 0
    assert prober.output().strip() == "0"


async def test_commands_inherit_no_agent_fd(sandbox: Sandbox) -> None:
    """The channel socket must not leak into commands (close_fds)."""
    res = await box_py(sandbox, "res = sorted(int(f) for f in os.listdir('/proc/self/fd'))")
    assert res == [0, 1, 2, 3]  # 3: listdir's own directory fd


async def test_compare_kernel_objects_with_kcmp(sandbox: Sandbox) -> None:
    code = "res = sc(312, os.getpid(), agent_pid(), 0, 0, 0)"  # KCMP_FILE
    assert await box_py(sandbox, code) == DENIED


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("init_module", (0, 0, "b''")),
        ("finit_module", (0, "b''", 0)),
        ("kexec_load", (0, 0, 0, 0)),
        ("reboot", (0xFEE1DEAD, 672274793, 0x4321FEDC, 0)),  # LINUX_REBOOT_CMD_POWER_OFF
        ("swapon", ("b'/tmp/swap'", 0)),
        ("syslog", (3, 0, 0)),  # SYSLOG_ACTION_READ_ALL
        ("userfaultfd", (0,)),
        ("iopl", (3,)),
    ],
)
async def test_kernel_and_hardware_control(
    sandbox: Sandbox, name: str, args: tuple[str | int, ...]
) -> None:
    assert await box_syscall(sandbox, name, *args) == DENIED


async def test_set_the_host_clock(sandbox: Sandbox) -> None:
    before = time.time()
    code = "ts = (ctypes.c_long * 2)(1, 0)\nres = [sc(227, 0, ts), sc(164, ts, 0)]"
    assert await box_py(sandbox, code) == [DENIED, DENIED]
    assert time.time() >= before  # the host clock did not jump to 1970


async def test_disable_aslr_with_personality(sandbox: Sandbox) -> None:
    assert await box_syscall(sandbox, "personality", 0x0040000) == DENIED  # ADDR_NO_RANDOMIZE


async def test_x32_syscall_bypass(sandbox: Sandbox) -> None:
    """x32 numbers carry bit 30; a filter keyed on x86_64 numbers alone would miss them."""
    needs_x86_64()
    program = PRELUDE + f"print(json.dumps(sc({X32_BIT | NR['keyctl']}, 0, -3, 1)))"
    r = await sandbox.run(["python3", "-c", program])
    # Refused (EPERM) or the process killed by seccomp (SIGSYS): either way no keyring.
    assert r.exit_code == -31 or json.loads(r.stdout) == DENIED, r


@pytest.fixture(scope="module")
def int80_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A static program that enters the kernel through the i386 ABI (int 0x80)."""
    needs_x86_64()
    src = tmp_path_factory.mktemp("int80") / "int80.c"
    src.write_text(
        "int main(void) {\n"
        "  long ret;\n"  # i386 syscall 20 is getpid
        '  __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(20) : "memory");\n'
        "  return ret > 0 ? 0 : 1;\n"
        "}\n"
    )
    out = src.with_suffix("")
    subprocess.run(["gcc", "-O1", "-static", "-o", str(out), str(src)], check=True)
    return out


async def test_foreign_syscall_abi_is_killed(
    sandbox: Sandbox, int80_program: Path, workspace: Path
) -> None:
    """int 0x80 uses i386 numbers the filter does not check: the process dies by SIGSYS."""
    (workspace / "int80").write_bytes(int80_program.read_bytes())
    (workspace / "int80").chmod(0o755)
    r = await sandbox.run(["./int80"])
    if gvisor(sandbox):  # gVisor implements no i386 ABI: the call fails, the host never sees it
        assert r.exit_code in (-31, 1), (r.exit_code, r.stderr)
        return
    assert r.exit_code == -31, (r.exit_code, r.stderr)  # SIGSYS
