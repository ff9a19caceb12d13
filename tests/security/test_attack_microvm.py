"""A selection of the attack suite on the microVM backend, in one VM, for ``make test``.

The attacks are the same functions as on the other backends, run against a module-scoped VM.
``make test-microvm`` runs the whole suite on the microVM backend (a VM per attack, restored
from a saved VM in under a second); this module keeps ``make test`` short.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from corral import Policy, Sandbox
from corral.backends import unavailable_reason
from corral.backends.microvm import jail
from corral.backends.users import BOX_UID
from security import test_attack_filesystem as fs
from security import test_attack_privilege as priv
from security import test_attack_processes as procs
from security.conftest import root_made_files

POLICY = Policy(
    backend="microvm", vm={"cpus": 2, "memory_mb": 384}, limits={"memory_bytes": 192 << 20}
)
SKIP = unavailable_reason(POLICY)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=f"microvm backend unavailable: {SKIP}"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sandbox(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sandbox]:
    sb = Sandbox(POLICY, workspace=tmp_path_factory.mktemp("vm-attack-ws"))
    await sb.start()
    yield sb
    await sb.aclose()


def _on_the_vm(
    category: str, attack: Callable[..., Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    """The attack as a test of this module (its own marks, such as parametrize, kept)."""

    @functools.wraps(attack)
    async def run(*args: Any, **kwargs: Any) -> None:
        await attack(*args, **kwargs)

    marked: Callable[..., Awaitable[None]] = pytest.mark.attack(category)(run)
    return marked


Attack = Callable[..., Awaitable[None]]

PRIVILEGE: list[Attack] = [
    priv.test_setuid_to_root,
    priv.test_setgroups_to_root_group,
    priv.test_raise_capabilities_with_capset,
    priv.test_raise_ambient_capability,
    priv.test_new_user_namespace_with_unshare,
    priv.test_new_namespaces_with_clone,
    priv.test_kernel_keyrings,
    priv.test_load_an_ebpf_program,
    priv.test_perf_event_open,
    priv.test_io_uring_setup,
    priv.test_ptrace_the_guest_agent,
    priv.test_read_the_agents_memory,
    priv.test_read_the_agents_fds_and_environment,
    priv.test_commands_inherit_no_agent_fd,
    priv.test_set_the_host_clock,
    priv.test_disable_aslr_with_personality,
]
FILESYSTEM: list[Attack] = [
    fs.test_dotdot_and_absolute_paths_through_file_tools,
    fs.test_read_the_hosts_shadow_file,
    fs.test_read_root_home_secrets,
    fs.test_read_a_root_only_host_file,
    fs.test_write_kernel_core_pattern,
    fs.test_mount_tmpfs_over_etc,
    fs.test_new_mount_api,
    fs.test_chroot,
    fs.test_pivot_root,
    fs.test_open_by_handle_escapes_bind_mounts,
]
PROCESSES: list[Attack] = [procs.test_signal_the_guest_agent]

for _category, _attacks in (
    ("privilege", PRIVILEGE),
    ("filesystem", FILESYSTEM),
    ("processes", PROCESSES),
):
    for _attack in _attacks:
        globals()[_attack.__name__] = _on_the_vm(_category, _attack)

_ = Path  # the attacks' annotations name it


@pytest.mark.attack("privilege")
async def test_setuid_binary_grants_nothing_in_the_vm(sandbox: Sandbox) -> None:
    """su is setuid root: no_new_privs, and the VM's root is mounted nosuid (one mount, not
    the per-directory binds the other backends check)."""
    r = await sandbox.run("su -c 'id -u' root </dev/null; grep NoNewPrivs /proc/self/status")
    assert "NoNewPrivs:\t1" in r.stdout and r.stdout.splitlines()[0] != "0"
    mounts = (await sandbox.run(["cat", "/proc/self/mounts"])).stdout
    root = [ln.split() for ln in mounts.splitlines() if ln.split()[1] == "/"]
    assert root and {"nosuid", "nodev"} <= set(root[-1][3].split(",")), root


# ---- the monitor's jail (issue 13, class 10) -----------------------------------------------


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.mark.attack("privilege")
async def test_qemu_is_jailed_on_the_host(sandbox: Sandbox) -> None:
    """A guest-kernel exploit lands in qemu: an unprivileged uid without capabilities, under
    no_new_privs and its own seccomp filter, in namespaces of its own, on a root holding qemu's
    files and the shares alone, in a cgroup of the box."""
    pid = (await sandbox.info())["qemu_pid"]
    status = _status(pid)
    uids = {int(u) for u in status["Uid"].split()} | {int(g) for g in status["Gid"].split()}
    assert 0 not in uids, status["Uid"]
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")
    for ns in ("user", "mnt", "pid", "ipc", "net", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert jail.SANDBOX.encode() in argv  # qemu's own filter: no spawn, no set*id
    if os.geteuid() == 0:  # an ordinary user's qemu has no host cgroup (ROOTLESS_NOTE)
        assert sandbox.sandbox_id in Path(f"/proc/{pid}/cgroup").read_text()
    else:
        assert any(w.startswith("rootless: qemu runs as you") for w in sandbox.warnings)
    root = Path(f"/proc/{pid}/root")
    top = set(os.listdir(root))
    kernel = Path(argv[argv.index(b"-kernel") + 1].decode())
    if os.geteuid() != 0 and kernel.parts[1] in top:
        # Rootless, the kernel and initramfs are in the user's cache (~/.cache, or /tmp/
        # corral-UID without a home): bound at their own paths, alone on the way there.
        below = root / kernel.parts[1]
        assert os.listdir(below) == [kernel.parts[2]], os.listdir(below)
        top.discard(kernel.parts[1])
    assert {"home", "root", "etc", "tmp", "work"}.isdisjoint(top), top
    assert {"view", "shares", "run", "usr"} <= top, top
    # The system view: what the other backends bind, nothing of /home, /tmp or /run.
    for private in ("home", "tmp", "run"):
        assert os.listdir(root / "view" / private) == [], private
    assert os.listdir(root / "shares") == ["ws"]


@pytest.fixture
def private_host_files() -> Iterator[Path]:
    """Host files outside every share, in the system view: one only uid 1000 may read, one
    only root may, and a uid-1000 home-like directory (0700) with a 0644 key in it."""
    made = root_made_files()
    if made is not None:  # rootless: the slice's runner made the same files as root
        yield made
        return
    base = Path("/opt") / f"corral-private-{secrets.token_hex(4)}"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    try:
        for name, uid in (("user-only", BOX_UID), ("root-only", 0)):
            f = base / name
            f.write_text(f"SECRET-{name}\n")
            f.chmod(0o600)
            os.chown(f, uid, uid)
        home = base / "home"
        home.mkdir(mode=0o700)
        (home / "id_key").write_text("SECRET-key\n")
        (home / "id_key").chmod(0o644)
        os.chown(home / "id_key", BOX_UID, BOX_UID)
        os.chown(home, BOX_UID, BOX_UID)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.attack("filesystem")
async def test_private_host_files_outside_the_shares_are_not_visible(
    sandbox: Sandbox, private_host_files: Path
) -> None:
    """Host uid 1000's private files (the box user's uid number) and root's: qemu used to run
    as root and show the host's owners, so the box user read uid 1000's files."""
    base = private_host_files
    script = (
        f"cd {base} || exit 9; ls -ln; "
        "for f in user-only root-only home/id_key; do cat $f 2>/dev/null; done; "
        "ls home 2>/dev/null; grep -rs SECRET . ; exit 0"
    )
    r = await sandbox.run(["sh", "-c", script], timeout=60)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert "SECRET" not in r.stdout and "id_key" not in r.stdout, r.stdout
    owners = {line.split()[2] for line in r.stdout.splitlines() if line.startswith(("-", "d"))}
    assert str(BOX_UID) not in owners, r.stdout  # host uid 1000 is not the box user
