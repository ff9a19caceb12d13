"""Filesystem escapes: writes outside the workspace, masked secrets, link tricks, /proc and /sys,
device nodes, mounts. Each asserts the precise refusal and (through ``host_guard``) that the
host's canary files, kernel.core_pattern and hostname are unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral import PathOutsideSandbox, Policy, Sandbox
from corral.errors import FilePermissionDenied, SandboxError
from security.conftest import Canary, root_made_files
from security.helpers import (
    box_py,
    box_syscall,
    gvisor,
    read_host,
    refused_or_kept_in_the_vm,
    root_is_copy_on_write,
)

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]


async def _canary_visible(sb: Sandbox, canary: Canary) -> None:
    """The attacks below are only meaningful if the box sees the canary (read-only)."""
    r = await sb.run(["cat", str(canary.file)])
    assert r.stdout == canary.content, f"canary not visible in the box: {r.stderr}"


async def test_overwrite_host_file_outside_workspace(sandbox: Sandbox, canary: Canary) -> None:
    await _canary_visible(sandbox, canary)
    res = await box_py(sandbox, f"res = err(lambda: open({str(canary.file)!r}, 'w').write('x'))")
    assert res in refused_or_kept_in_the_vm(sandbox, "EROFS")


async def test_delete_host_file_outside_workspace(sandbox: Sandbox, canary: Canary) -> None:
    await _canary_visible(sandbox, canary)
    res = await box_py(sandbox, f"res = err(os.unlink, {str(canary.file)!r})")
    assert res in refused_or_kept_in_the_vm(sandbox, "EROFS")


async def test_rename_host_file_outside_workspace(sandbox: Sandbox, canary: Canary) -> None:
    await _canary_visible(sandbox, canary)
    code = f"res = err(os.rename, {str(canary.file)!r}, {str(canary.dir / 'moved')!r})"
    assert await box_py(sandbox, code) in refused_or_kept_in_the_vm(sandbox, "EROFS")


async def test_chmod_and_truncate_host_file(sandbox: Sandbox, canary: Canary) -> None:
    await _canary_visible(sandbox, canary)
    path = str(canary.file)
    res = await box_py(
        sandbox, f"res = [err(os.chmod, {path!r}, 0o777), err(os.truncate, {path!r}, 0)]"
    )
    allowed = refused_or_kept_in_the_vm(sandbox, "EROFS")
    # not the file's owner (gVisor checks that before the read-only mount)
    vm_chmod = {"EPERM"} if root_is_copy_on_write(sandbox) or gvisor(sandbox) else set()
    assert res[0] in allowed | vm_chmod and res[1] in allowed, res


@pytest.mark.parametrize("target", ["/etc/corral-escape", "/usr/bin/corral-escape", "/corral-x"])
async def test_create_files_in_host_system_dirs(sandbox: Sandbox, target: str) -> None:
    res = await box_py(sandbox, f"res = err(lambda: open({target!r}, 'x'))")
    assert res in ("EROFS", "EACCES")
    assert not os.path.exists(target)


async def test_hardlink_host_file_into_workspace(
    sandbox: Sandbox, canary: Canary, workspace: Path
) -> None:
    """A hard link would let the box write the host file through the workspace."""
    await _canary_visible(sandbox, canary)
    res = await box_py(sandbox, f"res = err(os.link, {str(canary.file)!r}, 'hard')")
    assert res == "EXDEV"
    assert not (workspace / "hard").exists()


async def test_symlink_through_file_tools_to_host(
    sandbox: Sandbox, canary: Canary, workspace: Path
) -> None:
    """The agent's file writes follow no symlink out of the workspace (openat2 BENEATH)."""
    await sandbox.run(["ln", "-s", str(canary.dir), "out"])
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.write("out/pwned.txt", "x")
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.read("out/canary.txt")
    assert not (canary.dir / "pwned.txt").exists()


async def test_dotdot_and_absolute_paths_through_file_tools(sandbox: Sandbox) -> None:
    for bad in ("../../etc/passwd", "sub/../../x"):
        with pytest.raises(PathOutsideSandbox):
            await sandbox.files.read(bad)
    # Reading what a command can read is allowed (the box's view, as the command user);
    # writing outside the writable roots is not.
    for readable in ("/etc/passwd", "/workspace/../etc/hosts"):
        seen = await sandbox.run(["cat", readable])
        assert await sandbox.files.read(readable) == seen.stdout.encode()
    for bad in ("../escape.txt", "/etc/corral-escape", "/usr/corral-escape"):
        with pytest.raises(PathOutsideSandbox):
            await sandbox.files.write(bad, "x")
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.mkdir("/corral-x")
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.remove("/etc/hosts")
    assert "etc" in {e.name for e in await sandbox.files.list("/")}
    with pytest.raises(SandboxError):
        await sandbox.files.read("a\x00b")


async def test_symlink_swap_race_through_file_tools(sandbox: Sandbox) -> None:
    """A box process flips a symlink between a workspace dir and /home/user while the host
    writes through it: no write may land outside the workspace (TOCTOU)."""
    await sandbox.run("mkdir real")
    flipper = await sandbox.spawn(
        "while :; do ln -sfn /home/user d; ln -sfn real d; done", stdin=None
    )
    try:
        landed_outside = 0
        for i in range(40):
            try:
                await sandbox.files.write(f"d/f{i}", "x")
            except (PathOutsideSandbox, SandboxError):
                continue
        r = await sandbox.run("ls /home/user")
        landed_outside = len(r.stdout.split())
        assert landed_outside == 0, r.stdout
    finally:
        await flipper.kill()


async def test_read_the_hosts_shadow_file(sandbox: Sandbox) -> None:
    if not os.path.exists("/etc/shadow"):
        pytest.skip("the host has no /etc/shadow")
    res = await box_py(sandbox, "res = [err(lambda: open('/etc/shadow').read())]")
    assert res == ["EACCES"]


async def test_read_root_home_secrets(sandbox: Sandbox) -> None:
    res = await box_py(
        sandbox, "res = [err(os.listdir, '/root'), err(os.stat, '/root/.ssh/id_rsa')]"
    )
    assert res[0] in ("EACCES", "ENOENT") and res[1] in ("EACCES", "ENOENT")  # not there


async def test_policy_deny_read_survives_symlink_and_rename(
    workspace: Path, box_policy: Policy
) -> None:
    """A masked workspace file stays masked behind a symlink, a rename, the file tools."""
    (workspace / "secrets").mkdir()
    (workspace / "secrets" / "key").write_text("TOPSECRET\n")
    policy = box_policy.model_copy(
        update={"filesystem": box_policy.filesystem.model_copy(update={"deny_read": ("secrets",)})}
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("ln -s secrets/key alias; mv secrets s2; cat alias s2/key secrets/key")
        assert "TOPSECRET" not in r.stdout
        for path in ("secrets/key", "alias"):
            with pytest.raises((PathOutsideSandbox, FilePermissionDenied)):
                await sb.files.read(path)
    assert (workspace / "secrets" / "key").read_text() == "TOPSECRET\n"


async def test_read_a_root_only_host_file(sandbox: Sandbox, canary: Canary) -> None:
    """Commands are an unprivileged host uid; only the idmapped workspace is theirs. Rootless,
    commands are the user: root's file (made by the slice's runner) stays root's."""
    made = root_made_files()
    if made is not None:
        res = await box_py(sandbox, f"res = err(lambda: open({str(made / 'root-only')!r}).read())")
        assert res == "EACCES"
        return
    secret = canary.dir / "root-only.txt"
    secret.write_text("ROOTONLY\n")
    secret.chmod(0o600)
    try:
        res = await box_py(sandbox, f"res = err(lambda: open({str(secret)!r}).read())")
        assert res == "EACCES"
    finally:
        secret.unlink()


async def test_write_kernel_core_pattern(sandbox: Sandbox) -> None:
    """core_pattern = '|prog' runs prog as host root on the next crash: the classic escape."""
    res = await box_py(
        sandbox, "res = err(lambda: open('/proc/sys/kernel/core_pattern', 'w').write('|/x'))"
    )
    assert res in ("EROFS", "EACCES")
    assert read_host("/proc/sys/kernel/core_pattern") != "|/x\n"


@pytest.mark.parametrize(
    "knob",
    [
        "/proc/sys/kernel/modprobe",
        "/proc/sys/vm/drop_caches",
        "/proc/sys/kernel/hostname",
        "/proc/sysrq-trigger",
        "/proc/irq/default_smp_affinity",
    ],
)
async def test_write_proc_kernel_knobs(sandbox: Sandbox, knob: str) -> None:
    before = read_host(knob) if not knob.endswith(("drop_caches", "sysrq-trigger")) else None
    res = await box_py(sandbox, f"res = err(lambda: open({knob!r}, 'w').write('1'))")
    assert res in ("EROFS", "EACCES", "ENOENT")
    if res == "ENOENT" and not gvisor(sandbox):  # gVisor's /proc has no host kernel knobs
        assert not os.path.exists(knob), f"{knob} exists on the host but not in the box"
    if before is not None:
        assert read_host(knob) == before


@pytest.mark.parametrize(
    "path",
    ["/sys/kernel/mm/transparent_hugepage/enabled", "/sys/fs/cgroup/pids/cgroup.procs"],
)
async def test_write_sysfs(sandbox: Sandbox, path: str) -> None:
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this host")
    before = read_host(path) if "cgroup" not in path else None
    res = await box_py(sandbox, f"res = err(lambda: open({path!r}, 'w').write('1'))")
    assert res in ("EROFS", "EACCES", "ENOENT")  # ENOENT: the box has its own cgroup view
    if before is not None:
        assert read_host(path) == before


async def test_device_nodes_are_absent_and_cannot_be_made(sandbox: Sandbox) -> None:
    code = (
        "import stat\n"
        "res = [err(os.stat, p) for p in ('/dev/mem', '/dev/kmsg', '/dev/sda', '/dev/vda')]\n"
        "res.append(err(os.mknod, '/tmp/disk', stat.S_IFBLK | 0o600, os.makedev(8, 0)))\n"
        "res.append(err(os.mknod, '/tmp/mem', stat.S_IFCHR | 0o600, os.makedev(1, 1)))\n"
        "res += [err(lambda: open(p, 'rb')) for p in ('/tmp/disk', '/tmp/mem')]\n"
    )
    res = await box_py(sandbox, code)
    if gvisor(sandbox):
        # gVisor's tmpfs lets anyone make a node, but a node only ever opens one of gVisor's
        # own devices: these numbers name none (the host's disk and memory are not there).
        assert res[:4] == ["ENOENT"] * 4 and res[6:] == ["ENXIO", "ENXIO"], res
    else:
        assert res[:6] == ["ENOENT"] * 4 + ["EPERM", "EPERM"]


async def test_mount_tmpfs_over_etc(sandbox: Sandbox) -> None:
    res = await box_syscall(sandbox, "mount", "b'none'", "b'/etc'", "b'tmpfs'", 0, 0)
    assert res == {"ret": -1, "errno": "EPERM"}


async def test_unmount_a_deny_read_mask(sandbox: Sandbox) -> None:
    res = await box_syscall(sandbox, "umount2", "b'/etc/shadow'", 2)  # MNT_DETACH
    assert res == {"ret": -1, "errno": "EPERM"}


async def test_new_mount_api(sandbox: Sandbox) -> None:
    res = [
        await box_syscall(sandbox, "fsopen", "b'tmpfs'", 0),
        await box_syscall(sandbox, "open_tree", -100, "b'/'", 1),  # OPEN_TREE_CLONE
    ]
    assert res == [{"ret": -1, "errno": "EPERM"}] * 2


async def test_chroot(sandbox: Sandbox) -> None:
    assert await box_syscall(sandbox, "chroot", "b'/tmp'") == {"ret": -1, "errno": "EPERM"}


async def test_pivot_root(sandbox: Sandbox) -> None:
    res = await box_syscall(sandbox, "pivot_root", "b'/tmp'", "b'/tmp'")
    assert res == {"ret": -1, "errno": "EPERM"}


async def test_open_by_handle_escapes_bind_mounts(sandbox: Sandbox) -> None:
    """The 'shocker' escape: a file handle opened relative to the host fs's root."""
    res = [
        await box_syscall(sandbox, "name_to_handle_at", -100, "b'/etc/hostname'", 0, 0, 0),
        await box_syscall(sandbox, "open_by_handle_at", 3, 0, 0),
    ]
    assert res == [{"ret": -1, "errno": "EPERM"}] * 2


async def test_write_the_guest_agent_code(sandbox: Sandbox) -> None:
    code = (
        "res = [err(lambda: open(p + '/agent.py', 'a').write('#'), ) for p in "
        "[os.path.dirname(open(f'/proc/{agent_pid()}/cmdline','rb').read().split(b'\\0')[2]"
        ".decode())]]"
    )
    assert await box_py(sandbox, code) in (["EROFS"], ["EACCES"])


async def test_remove_the_workspace_mount(sandbox: Sandbox, workspace: Path) -> None:
    res = await box_py(
        sandbox, "res = [err(os.rename, '/workspace', '/ws2'), err(os.rmdir, '/workspace')]"
    )
    assert res[0] in ("EBUSY", "EROFS", "EACCES") and res[1] in ("EBUSY", "EROFS", "EACCES")
    assert workspace.is_dir()


async def test_minimal_root_hides_host_trees(workspace: Path, box_policy: Policy) -> None:
    policy = box_policy.model_copy(
        update={"filesystem": box_policy.filesystem.model_copy(update={"inherit_readable": False})}
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        res = await box_py(sb, "res = [err(os.stat, p) for p in ('/work', '/srv', '/var', '/opt')]")
    assert res == ["ENOENT"] * 4
