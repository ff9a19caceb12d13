"""The microVM backend: one VM per module (a TCG boot takes seconds), a slice of the contract.

Every feature reaches the VM through the same guest agent as the other backends, so this
module checks the slice that depends on the VM itself: the channel over virtio-serial, the
9p shares and their modes, the ephemeral root, no network, info from the guest kernel, and
that closing (or losing) a VM leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from corral import PathOutsideSandbox, Policy, Sandbox
from corral.backends import unavailable_reason
from corral.backends.host.state import state_root
from corral.backends.microvm import initramfs
from corral.errors import BackendError, SandboxBroken

POLICY = Policy(
    backend="microvm", vm={"cpus": 2, "memory_mb": 384}, limits={"memory_bytes": 192 << 20}
)
SKIP = unavailable_reason(POLICY)
PROMPT = r"\$ $"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=f"microvm backend unavailable: {SKIP}"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest.fixture(scope="module")
def vm_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vm-ws")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vm(vm_workspace: Path) -> AsyncIterator[Sandbox]:
    sb = Sandbox(POLICY, workspace=vm_workspace)
    await sb.start()
    yield sb
    await sb.aclose()


async def test_exit_code_and_both_streams(vm: Sandbox) -> None:
    r = await vm.run("echo out; echo err >&2; exit 3", timeout=30)
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")


async def test_commands_run_as_an_unprivileged_user(vm: Sandbox) -> None:
    r = await vm.run(["id", "-u"], timeout=30)
    assert r.stdout.strip() != "0"


async def test_stdin_cwd_and_env(vm: Sandbox) -> None:
    r = await vm.run(["tr", "a-z", "A-Z"], stdin="hello\n", timeout=30)
    assert r.stdout == "HELLO\n"
    await vm.files.mkdir("sub/dir")
    r = await vm.run("pwd; echo $FOO", cwd="sub/dir", env={"FOO": "bar"}, timeout=30)
    assert r.stdout == "/workspace/sub/dir\nbar\n"


async def test_timeout_kills_the_group(vm: Sandbox) -> None:
    r = await vm.run(
        "echo started; (sleep 30; touch survived) & echo $! > /workspace/child; sleep 30",
        timeout=1.5,
    )
    assert r.timed_out and r.exit_code == -15 and r.stdout == "started\n"
    assert r.ended == "timed_out" and r.timeout == 1.5
    child = (await vm.files.read_text("child")).strip()
    gone = await vm.run(["sh", "-c", f"kill -0 {child} 2>/dev/null && echo alive || echo gone"])
    assert gone.stdout == "gone\n"


async def test_a_cancelled_run_sends_term_then_kill_and_leaves_nothing(vm: Sandbox) -> None:
    """The order seen from inside the VM: the trap logs the SIGTERM, the SIGKILL follows the
    grace (``kill_grace_secs``, 2 s by default), then nothing of the group is left."""
    stubborn = (
        "trap 'echo TERM >> /workspace/order' TERM; echo $$ > /workspace/stubborn; "
        "(sleep 302; echo survived >> /workspace/order) & while :; do sleep 1; done"
    )
    run = asyncio.create_task(vm.run(["sh", "-c", stubborn]))
    ready = await vm.run("while [ ! -s /workspace/stubborn ]; do sleep 0.05; done", timeout=60)
    assert ready.exit_code == 0
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    left = await vm.run("ps -eo args | grep -c '^sleep 30[2]' || true", timeout=30)
    assert left.stdout == "0\n"
    assert await vm.files.read_text("order") == "TERM\n"
    [proc] = [p for p in vm.registry.list() if "sleep 302" in p.command]
    assert proc.exit_code == -9


async def test_background_process_and_wait(vm: Sandbox) -> None:
    p = await vm.spawn("echo first; read line; echo got $line", stdin="pipe")
    assert (await p.wait(timeout=0.05)).status == "timeout"
    await p.write("x\n", eof=True)
    done = await p.wait(timeout=30)
    assert done.exit_code == 0
    assert p.output() == "first\ngot x\n"


async def test_pty_session_with_expect(vm: Sandbox) -> None:
    sh = await vm.shell()
    try:
        assert (await sh.expect(PROMPT, 30)).matched
        await sh.write("printf 'ans%s\\n' wer=$((6*7))\n")
        m = await sh.expect(r"answer=(\d+)", 30)
        assert m.matched and m.captures[1:] == ["42"]
    finally:
        await sh.close()


async def test_files_round_trip_and_traversal_is_refused(vm: Sandbox, vm_workspace: Path) -> None:
    await vm.files.write("notes/a.txt", "hello vm")
    assert await vm.files.read_text("notes/a.txt") == "hello vm"
    assert await vm.files.exists("notes/a.txt")
    assert not await vm.files.exists("notes/missing")
    assert [f.name for f in await vm.files.list("notes")] == ["a.txt"]
    assert (vm_workspace / "notes/a.txt").read_text() == "hello vm"  # on the host, via 9p
    (vm_workspace / "from-host.txt").write_text("host side")
    r = await vm.run(["cat", "from-host.txt"], timeout=30)
    assert r.stdout == "host side"
    with pytest.raises(PathOutsideSandbox):
        await vm.files.read("../etc/passwd")


async def test_info_reports_the_guest(vm: Sandbox) -> None:
    info = await vm.info()
    assert info["backend"] == "microvm"
    assert info["kernel"].startswith("Linux ")
    assert info["kernel"].split()[1] == initramfs.find_kernel().version
    assert info["cpus"] == 2
    assert 300 << 20 < info["memory_bytes"] <= 384 << 20
    assert info["hostname"] == "corral"
    assert info["accel"] in ("kvm", "tcg")


async def test_no_network_but_loopback(vm: Sandbox) -> None:
    r = await vm.run(["ls", "/sys/class/net"], timeout=30)
    assert r.stdout.split() == ["lo"]


async def test_writes_outside_the_workspace_fail_or_stay_in_the_vm(vm: Sandbox) -> None:
    marker = f"corral-vm-{vm.sandbox_id}"
    r = await vm.run(f"touch /etc/{marker}", timeout=30)
    assert r.exit_code != 0
    r = await vm.run(f"echo x > /tmp/{marker} && cat /tmp/{marker}", timeout=30)
    assert r.stdout == "x\n"
    assert not Path(f"/etc/{marker}").exists() and not Path(f"/tmp/{marker}").exists()
    r = await vm.run(["cat", "/root/.bashrc"], timeout=30)  # host root's home: masked
    assert r.exit_code != 0


async def test_commands_run_under_the_same_seccomp_filter(vm: Sandbox) -> None:
    """The guest kernel is one more layer, not the only one: the host's filter holds too."""
    status = (await vm.run("grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status", timeout=30)).stdout
    assert status.split() == ["NoNewPrivs:", "1", "Seccomp:", "2"], status
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))\n"  # CLONE_NEWUSER
        "print(libc.syscall(250, 0, 0, 0, 0, 0), os.strerror(ctypes.get_errno()))\n"  # keyctl
    )
    r = await vm.run(["python3", "-c", probe], timeout=60)
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("-1 ") for line in lines), (r.stdout, r.stderr)


async def test_close_leaves_nothing(vm: Sandbox) -> None:
    pid = (await vm.info())["qemu_pid"]
    state = state_root() / "boxes" / vm.sandbox_id
    assert state.is_dir()
    await vm.aclose()
    assert not state.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # qemu's host cgroup and the idmapped mounts of its shares are gone too.
    cgroup = Path("/sys/fs/cgroup")
    assert not [*cgroup.glob(f"*/corral/{vm.sandbox_id}"), *cgroup.glob(f"corral/{vm.sandbox_id}")]
    assert not list((state_root() / "mnt").glob(f"{vm.sandbox_id}.*"))


async def run_until_broken(sb: Sandbox) -> None:
    async with asyncio.timeout(30):
        while True:  # the channel notices qemu's EOF; no request may hang
            await sb.run(["true"], timeout=10)


async def test_a_vm_that_dies_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    async with Sandbox(Policy(backend="microvm"), workspace=tmp_path) as sb:
        pid = (await sb.info())["qemu_pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SandboxBroken):
            await run_until_broken(sb)
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


# ---- snapshots: the second VM of a shape is restored, not booted ----------------------------


async def test_restored_vms_share_no_randomness_and_keep_the_hosts_time(tmp_path: Path) -> None:
    policy = Policy(backend="microvm")
    script = (
        "cat /proc/sys/kernel/random/boot_id /proc/sys/kernel/random/uuid; "
        "grep -m1 stack /proc/self/maps | cut -d- -f1; date +%s.%N"
    )
    seen: list[list[str]] = []
    for _ in range(2):
        async with Sandbox(policy, workspace=tmp_path) as sb:
            r = await sb.run(script, timeout=30)
            host_now = time.time()
            boot_id, uuid, stack, clock = r.stdout.split()
            assert abs(float(clock) - host_now) < 3, (clock, host_now)
            seen.append([boot_id, uuid, stack])
            how = (await sb.info())["boot"]
    assert how == "restored"  # the first VM of the shape saved it, at the latest
    for first, second in zip(seen[0], seen[1], strict=True):
        assert first != second


async def test_a_damaged_snapshot_is_replaced_and_snapshots_can_be_off(tmp_path: Path) -> None:
    # The default shape, which the tests above saved: the first box is restored (no boot),
    # the damaged file makes the second boot and save anew, and the third boots without one.
    policy = Policy(backend="microvm")
    async with Sandbox(policy, workspace=tmp_path) as sb:
        saved = Path((await sb.info())["snapshot"])
    assert saved.is_file()
    saved.write_bytes(b"not a saved VM")
    async with Sandbox(policy, workspace=tmp_path) as sb:
        info = await sb.info()
        assert info["boot"] == "booted, saved and restored"
        assert any("did not restore" in w for w in info["unenforced"]), info["unenforced"]
        assert (await sb.run(["echo", "ok"], timeout=30)).stdout == "ok\n"
    assert saved.stat().st_size > 1 << 20  # a new, whole VM
    off = policy.model_copy(update={"vm": policy.vm.model_copy(update={"snapshot": False})})
    async with Sandbox(off, workspace=tmp_path) as sb:
        info = await sb.info()
        assert info["boot"] == "booted" and info["snapshot"] is None


async def test_the_caller_chooses_how_long_a_start_waits_for_readiness(tmp_path: Path) -> None:
    """The wait for the agent's readiness is ``Sandbox(ready_timeout=...)`` (the backend's
    own waits by default): a VM not ready within it fails naming the option, and leaves
    nothing behind."""
    sb = Sandbox(POLICY, workspace=tmp_path, ready_timeout=0.05)
    started = time.monotonic()
    with pytest.raises(BackendError, match=r"0\.05 s.*ready_timeout"):
        await sb.start()
    assert time.monotonic() - started < 60  # a boot, then 0.05 s: not the 90 s TCG default
    assert not (state_root() / "boxes" / sb.sandbox_id).exists()


async def test_a_box_on_an_image_without_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's entries are the VM's root share (bound read-only on a staging point qemu's
    uid reaches), under the guest's tmpfs overlay of ``root_size``; the agent runs on the
    initramfs's own Python. Config honoured (Env, a WorkingDir the image lacks made), the cap
    holds, the image in the store unchanged. (Same VM shape as the others: restored.)"""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from oci_images import busybox_root, dir_tar, write_layout

    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = busybox_root(tmp_path / "root")
    (root / "scratch").mkdir(mode=0o1777)
    (root / "scratch").chmod(0o1777)
    config: dict[str, object] = {"Env": ["PATH=/bin", "FROM=image"], "WorkingDir": "/srv/task"}
    layout = write_layout(tmp_path / "layout", [dir_tar(root)], config=config).path
    policy = POLICY.model_copy(
        update={
            "image": str(layout),
            "filesystem": POLICY.filesystem.model_copy(update={"root_size": 2 << 20}),
        }
    )
    async with Sandbox(policy, workspace=tmp_path / "root" / "etc") as sb:
        r = await sb.run(
            'cat /etc/hello; echo "$FROM"; pwd; id -u; command -v python3 || echo no-python; '
            "dd if=/dev/zero of=/scratch/big bs=1M count=8 2>&1; echo dd=$?"
        )
        assert r.stdout.splitlines()[:5] == [
            "hello from the image",
            "image",
            "/srv/task",
            "1000",
            "no-python",
        ], r
        assert "No space left on device" in r.stdout and "dd=1" in r.stdout, r
        assert (await sb.info())["image"]["writable"] is True
        entry = state_root() / "mnt" / f"{sb.sandbox_id}.vmimage"
        if os.geteuid() == 0:  # as root the store is root's: the image staged for qemu
            st = entry.stat()  # not readable by other users through it
            assert st.st_mode & 0o777 == 0o700 and st.st_uid != 0, oct(st.st_mode)
    assert not entry.exists()  # released with the box
    from corral.images import resolve_image

    stored = resolve_image(str(layout)).rootfs
    assert stored is not None and not (stored / "scratch" / "big").exists()
    assert not (stored / "srv").exists()


async def test_a_memory_limit_no_vm_here_can_hold_is_refused_naming_it(tmp_path: Path) -> None:
    # qemu failed to allocate the RAM ("cannot set up guest memory"): backend_failed, while
    # bwrap and OCI boxes start with the same 5 TiB limit. Refused before qemu runs.
    from corral import PolicyError

    policy = Policy(backend="microvm", limits={"memory_bytes": 5 << 40})
    with pytest.raises(PolicyError, match=r"limits\.memory_bytes: the microVM would need"):
        async with Sandbox(policy, workspace=tmp_path):
            pass
