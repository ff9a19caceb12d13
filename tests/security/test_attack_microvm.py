"""A selection of the attack suite on the microVM backend, in one VM, for ``make test``.

The attacks are the same functions as on the other backends, run against a module-scoped VM.
``make test-microvm`` runs the whole suite on the microVM backend (a VM per attack, restored
from a saved VM in under a second); this module keeps ``make test`` short.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from corral import Policy, Sandbox
from corral.backends import unavailable_reason
from security import test_attack_filesystem as fs
from security import test_attack_privilege as priv
from security import test_attack_processes as procs

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
