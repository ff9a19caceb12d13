"""The OCI backend beyond the contract suite: runtime choice, teardown, orphan sweep.

The contract suite (every test taking ``sandbox``) already runs on runc and crun; these
tests cover what only this backend has: the runtime's state, cgroups in every hierarchy,
and containers that outlive a SIGKILLed owner (a detached runtime has no parent to die with).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Policy, Sandbox, SandboxBroken
from corral.backends.host.state import state_root
from corral.backends.oci import box as oci
from corral.errors import BackendUnavailable
from corral.net.nat import missing_tools
from corral.policy import NetworkPolicy
from test_lifecycle import box_processes, wait_pid_gone


@pytest.fixture(params=["runc", "crun"])
def runtime(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    backend_policy(f"oci-{name}")  # skips when the runtime cannot run here
    return name


def oci_policy(runtime: str) -> Policy:
    return Policy.from_dict({"backend": "oci", "runtime": runtime})


def cgroup_dirs(box_id: str) -> list[Path]:
    """The box's group in every hierarchy: the runtime makes it in all of them."""
    return [
        *Path("/sys/fs/cgroup").glob(f"*/corral/{box_id}"),
        *Path("/sys/fs/cgroup").glob(f"corral/{box_id}"),
    ]


def leftovers(box_id: str, runtime: str) -> dict[str, object]:
    return {
        "processes": box_processes(box_id),
        "cgroups": cgroup_dirs(box_id),
        "state dir": (state_root() / "boxes" / box_id).exists(),
        "runtime state": (state_root() / "oci" / runtime / box_id).exists(),
    }


NOTHING = {"processes": [], "cgroups": [], "state dir": False, "runtime state": False}


# ---- runtime choice ------------------------------------------------------------------------


def test_a_missing_runtime_is_unavailable_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendUnavailable) as info:
        oci.OciBackend.for_policy(oci_policy("runc"))
    assert "'runc' is not installed" in info.value.message and "install runc" in info.value.message


def test_without_any_runtime_every_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendUnavailable) as info:
        oci.OciBackend.for_policy(Policy(backend="oci"))
    for name in oci.RUNTIMES:
        assert f"{name!r} is not installed" in info.value.message


async def test_an_unavailable_runtime_fails_the_sandbox_start_cleanly(
    monkeypatch: pytest.MonkeyPatch, workspace: Path
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendUnavailable):
        async with Sandbox(oci_policy("crun"), workspace=workspace):
            pass


@pytest.mark.skipif(shutil.which("runsc") is not None, reason="gVisor is installed here")
def test_runsc_is_unavailable_here_and_says_where_to_get_it() -> None:
    with pytest.raises(BackendUnavailable) as info:
        oci.find_runtime("runsc")
    assert "gvisor.dev" in info.value.message


def test_the_default_runtime_is_the_first_that_works() -> None:
    backend_policy("oci-crun")
    assert oci.OciBackend.for_policy(Policy(backend="oci")).runtime.name == oci.RUNTIMES[0]


@pytest.mark.skipif(bool(missing_tools()), reason="full mode needs pasta, nft and nsenter")
async def test_full_network_mode_joins_a_fenced_namespace_and_keeps_sys_read_only(
    runtime: str, workspace: Path
) -> None:
    policy = oci_policy(runtime).model_copy(update={"network": NetworkPolicy(mode="full")})
    async with Sandbox(policy, workspace=workspace) as sb:
        links = (await sb.run("cat /proc/net/dev")).stdout.splitlines()[2:]
        assert [ln for ln in links if ln.split(":")[0].strip() != "lo"]  # pasta's interface
        assert "refused" in (await sb.run("nft flush ruleset 2>&1 || echo refused")).stdout
        # The host's /sys (only the namespace's owner may mount a sysfs), read-only down to
        # every submount (cgroups, bpf, security fs).
        info = (await sb.run("cat /proc/self/mountinfo")).stdout.splitlines()
        sys_mounts = {f[4]: f[5].split(",") for f in (ln.split() for ln in info)}
        sys_mounts = {p: o for p, o in sys_mounts.items() if p == "/sys" or p.startswith("/sys/")}
        assert "/sys" in sys_mounts and len(sys_mounts) > 1
        assert {p for p, opts in sys_mounts.items() if "ro" not in opts} == set()
        sid = sb.sandbox_id
    held = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if sid in ln]
    assert held == []


def test_the_cli_picks_backend_and_runtime(runtime: str, workspace: Path) -> None:
    cli = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(workspace)]
    r = subprocess.run(
        [*cli, "--runtime", runtime, "--", "sh", "-c", "hostname; cat /proc/1/comm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    hostname, init = r.stdout.split()
    assert hostname == "corral" and init.startswith("python3")  # agent is PID 1: an OCI box
    bad = subprocess.run(
        [*cli, "--backend", "bwrap", "--runtime", runtime, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "needs --backend oci" in bad.stderr


def test_a_hybrid_cgroup_host_is_recognised(tmp_path: Path) -> None:
    v1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu"
    v2 = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
    pure_v2 = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw"
    cases = {
        "hybrid": ([v1, v2], "/sys/fs/cgroup/unified"),
        "v1": ([v1], None),
        "v2": ([pure_v2], None),
    }
    for name, (lines, expected) in cases.items():
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        assert oci.hybrid_cgroup2_mount(str(path)) == expected, name


# ---- a box's life --------------------------------------------------------------------------


async def test_info_names_the_backend_and_runtime(runtime: str, workspace: Path) -> None:
    async with Sandbox(oci_policy(runtime), workspace=workspace) as sb:
        info = await sb.info()
        assert (info["backend"], info["runtime"]) == ("oci", runtime)
        assert info["agent_pid"] == 1  # the agent is the box's init: when it exits, all do
        stats = sb.stats()
        assert stats.memory_bytes and stats.pids


async def test_close_leaves_no_process_cgroup_state_or_bundle(
    runtime: str, workspace: Path
) -> None:
    sb = Sandbox(oci_policy(runtime), workspace=workspace)
    await sb.start()
    await sb.spawn("sleep 300 & sleep 300")
    await sb.spawn(["sh", "-c", "setsid sleep 300"])
    sid = sb.sandbox_id
    assert all(leftovers(sid, runtime).values())
    await sb.aclose()
    assert leftovers(sid, runtime) == NOTHING


async def test_a_killed_agent_breaks_the_sandbox_cleanly(runtime: str, workspace: Path) -> None:
    async with Sandbox(oci_policy(runtime), workspace=workspace) as sb:
        p = await sb.spawn("sleep 300")
        assert isinstance(sb._box, oci.OciBox)
        init = sb._box.init_pid
        assert init is not None
        os.kill(init, signal.SIGKILL)
        result = await p.wait(timeout=10)
        assert result.status == "exited" and result.exit_code == -9
        with pytest.raises(SandboxBroken):
            await sb.run("true")
        sid = sb.sandbox_id
    assert leftovers(sid, runtime) == NOTHING


# ---- orphans -------------------------------------------------------------------------------

SCRIPT = """
import asyncio, json, sys
from corral import Policy, Sandbox

async def main():
    sb = Sandbox(Policy(backend="oci", runtime=sys.argv[1]))
    await sb.start()
    await sb.spawn("sleep 300")
    print(json.dumps({"id": sb.sandbox_id, "init": sb._box.init_pid}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


FIRST_START = """
import asyncio, sys
from corral import Policy, Sandbox

async def main():
    async with Sandbox(Policy(backend="oci", runtime=sys.argv[1])) as sb:
        await sb.run("true")

asyncio.run(main())
"""


def test_sigkill_of_the_owner_leaves_nothing_after_the_next_start(runtime: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, runtime], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    with proc.stdout:
        info = json.loads(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    sid = info["id"]
    assert (state_root() / "boxes" / sid).exists()  # nobody cleaned up: the owner is dead
    # A process's first start sweeps first (in a thread), before its own box starts.
    subprocess.run([sys.executable, "-c", FIRST_START, runtime], check=True, timeout=60)
    assert wait_pid_gone(info["init"], 10)
    assert leftovers(sid, runtime) == NOTHING


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (the owner of an orphaned box)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_the_sweep_kills_a_running_box_whose_owner_is_gone(
    runtime: str, workspace: Path, dead_pid: int
) -> None:
    async with Sandbox(oci_policy(runtime), workspace=workspace) as sb:
        sid = sb.sandbox_id
        owner_file = state_root() / "boxes" / sid / "owner.json"
        owner = json.loads(owner_file.read_text())
        owner_file.write_text(json.dumps({**owner, "host_pid": dead_pid}))
        assert sid in oci.sweep_orphans([oci.find_runtime(runtime)])
        assert leftovers(sid, runtime) == NOTHING
        with pytest.raises(SandboxBroken):
            await sb.run("true")
    # close() after the sweep is a no-op that still succeeds.
    assert leftovers(sid, runtime) == NOTHING


def test_the_sweep_leaves_boxes_of_other_backends_and_live_owners_alone(tmp_path: Path) -> None:
    boxes = state_root() / "boxes"
    boxes.mkdir(parents=True, exist_ok=True)
    other = boxes / "cb-sweeptest-bwrap"
    live = boxes / "cb-sweeptest-live"
    try:
        for entry, owner in (
            (other, {"backend": "bwrap", "host_pid": 0}),
            (live, {"backend": "oci", "runtime": "runc", "host_pid": os.getpid()}),
        ):
            entry.mkdir()
            (entry / "owner.json").write_text(json.dumps(owner))
        runtime = oci.Runtime("runc", "/nonexistent/runc", tmp_path / "root")
        assert oci.sweep_orphans([runtime]) == []
        assert other.exists() and live.exists()
    finally:
        for entry in (other, live):
            (entry / "owner.json").unlink(missing_ok=True)
            entry.rmdir()


# ---- the seccomp export, enforced by a real runtime ----------------------------------------

PROBE = """
import ctypes, errno, fcntl, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def res(ret):
    return errno.errorcode.get(ctypes.get_errno(), "?") if ret == -1 else "ok"
out = [
    res(libc.syscall(135, ctypes.c_ulong(0x0040000))),          # personality(ADDR_NO_RANDOMIZE)
    res(libc.syscall(135, ctypes.c_ulong(0xFFFFFFFF))),         # personality query: allowed
    res(libc.syscall(435, None, ctypes.c_size_t(88))),          # clone3: ENOSYS, libc falls back
    res(libc.syscall(16, 0, ctypes.c_ulong(1 << 32 | termios.TIOCSTI), b"x")),  # TIOCSTI, high bits
    res(libc.syscall(272, ctypes.c_ulong(0x10000000))),         # unshare(CLONE_NEWUSER)
]
print(" ".join(out))
"""


async def test_the_seccomp_rules_hold_under_the_runtime(runtime: str, workspace: Path) -> None:
    async with Sandbox(oci_policy(runtime), workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", PROBE])
        assert r.stdout.split() == ["EPERM", "ok", "ENOSYS", "EPERM", "EPERM"], r.stderr


# ---- runsc (gVisor) --------------------------------------------------------------------------
@pytest.fixture
def runsc() -> Policy:
    return backend_policy("oci-runsc")


async def test_runsc_box_writes_as_the_workspace_owner(runsc: Policy, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, 1234, 1235)
    async with Sandbox(runsc, workspace=ws) as sb:
        r = await sb.run("id -u; mkdir d && echo x > d/f && ls -ln d/f", check=True)
        await sb.files.write("tool.txt", "y")
    uid, listing = r.stdout.splitlines()
    assert uid == "1000" and listing.split()[2:4] == ["1000", "1000"]  # the box user inside
    for path in (ws / "d", ws / "d" / "f", ws / "tool.txt"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (1234, 1235), path  # the owner on the host


async def test_runsc_box_cannot_read_a_host_users_private_file(
    runsc: Policy, workspace: Path, tmp_path: Path
) -> None:
    # Box uid 1000 is not host uid 1000: a 0600 file of that host user stays unreadable.
    secret = Path("/opt") / f"corral-test-{os.getpid()}"  # in the system view
    secret.write_text("private")
    os.chown(secret, 1000, 1000)
    secret.chmod(0o600)
    try:
        async with Sandbox(runsc, workspace=workspace) as sb:
            r = await sb.run(["cat", str(secret)])
        assert r.exit_code != 0 and "private" not in r.stdout
    finally:
        secret.unlink()


async def test_runsc_commands_see_gvisor_and_stat_works(runsc: Policy, workspace: Path) -> None:
    async with Sandbox(runsc, workspace=workspace) as sb:
        assert not sb.warnings
        r = await sb.run("cat /proc/version; ls -ld /workspace; stat -c %u /workspace")
    version, listing, owner = r.stdout.splitlines()
    # gVisor's kernel answers, not the host's (it reports a fixed old version).
    assert version != Path("/proc/version").read_text().strip()
    assert listing.startswith("drwx") and owner == "1000"  # statx works (the compat library)


async def test_runsc_refuses_full_network_mode_with_the_reason(
    runsc: Policy, workspace: Path
) -> None:
    policy = runsc.model_copy(update={"network": NetworkPolicy(mode="full")})
    with pytest.raises(BackendUnavailable, match="'full' is not available with runsc"):
        async with Sandbox(policy, workspace=workspace):
            pass
