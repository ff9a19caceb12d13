"""Rootless OCI boxes (runc and crun run by an ordinary user, corral.backends.oci.rootless):
the same guarantees as a rootless bwrap box, limits as rlimits, each one said."""

from __future__ import annotations

import asyncio
import json
import os
import select
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.backends.host.state import state_root
from corral.backends.layout import PTY_MAX
from corral.backends.oci.box import OciBox
from corral.errors import BackendUnavailable
from corral.net import StaticResolver

RUNTIMES = ["crun", "runc"]


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def oci_box(workspace: Path, runtime: str) -> AsyncIterator[Sandbox]:
    async with Sandbox(Policy(backend="oci", runtime=runtime), workspace=workspace) as sb:
        yield sb


def _init_pid(sb: Sandbox) -> int:
    assert isinstance(sb._box, OciBox)
    init = sb._box.init_pid
    assert init is not None
    return init


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


async def test_a_box_runs_rootless_and_says_how(
    oci_box: Sandbox, runtime: str, mapped: bool
) -> None:
    info = await oci_box.info()
    assert info["backend"] == "oci" and info["runtime"] == runtime
    cgroup = "delegated cgroup v2" if os.environ.get("CORRAL_CGROUP_DELEGATE") else "rlimits"
    assert info["rootless"] == {"ids": "subordinate" if mapped else "single", "limits": cgroup}
    unenforced = " | ".join(info["unenforced"])
    assert "limits.max_pids enforced as RLIMIT_NPROC" in unenforced
    assert "limits.memory_bytes enforced per process only (RLIMIT_AS" in unenforced
    if not mapped:
        assert "usermod --add-subuids" in unenforced  # the weaker separation, and its fix
    r = await oci_box.run("id -u; grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status")
    lines = r.stdout.splitlines()
    assert lines[0] == ("1000" if mapped else "0"), r
    assert all(line.split()[1] == "0000000000000000" for line in lines[1:]), r.stdout
    agent = info["agent_pid"]  # in the box's pid namespace
    init = _init_pid(oci_box)  # the agent too, on the host
    # The agent is the subordinate range's first id where there is one, never the user.
    assert (_host_uid(init) != os.getuid()) is mapped
    probe = await oci_box.run(f"kill -0 {agent} && echo reached; cat /proc/{agent}/environ")
    assert probe.exit_code != 0 and ("reached" not in probe.stdout or not mapped)


async def test_what_commands_write_in_the_workspace_is_the_users(
    oci_box: Sandbox, workspace: Path
) -> None:
    r = await oci_box.run("echo hi > out.txt && mkdir -p d/e && touch d/e/f")
    assert r.exit_code == 0, r.stderr
    for path in (workspace / "out.txt", workspace / "d" / "e" / "f"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    await oci_box.files.write("tool.txt", "from the tool")
    assert (workspace / "tool.txt").stat().st_uid == os.getuid()
    assert await oci_box.files.read_text("out.txt") == "hi\n"


@pytest.mark.parametrize(
    "attack",
    [
        "touch /usr/corral-escape",  # the root is read-only
        "echo x > /etc/passwd",
        "mount -t tmpfs none /mnt",
        "unshare -r true",
        "echo b > /proc/sysrq-trigger",
        "cat /etc/shadow",
        "ls /root",
        "nsenter -t 1 -m true",
    ],
)
async def test_escape_attempts_fail(oci_box: Sandbox, attack: str) -> None:
    r = await oci_box.run(attack)
    assert r.exit_code != 0, (attack, r.stdout)


async def test_the_users_credentials_stay_masked_and_tmp_private(
    tmp_path: Path, workspace: Path, runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("SECRET-KEY")
    monkeypatch.setenv("HOME", str(home))
    host_file = Path("/tmp") / f"corral-rootless-oci-{os.getpid()}"
    host_file.write_text("host")
    try:
        async with Sandbox(Policy(backend="oci", runtime=runtime), workspace=workspace) as sb:
            r = await sb.run(f"cat {home}/.ssh/id_ed25519; ls -a {home}/.ssh; ls {host_file}")
            w = await sb.run(f"echo planted > {home}/.ssh/id_ed25519")
    finally:
        host_file.unlink()
    assert "SECRET" not in r.stdout and "id_ed25519" not in r.stdout, r
    assert w.exit_code != 0
    assert (home / ".ssh" / "id_ed25519").read_text() == "SECRET-KEY"


async def test_memory_and_processes_are_bounded_by_rlimits(workspace: Path, runtime: str) -> None:
    policy = Policy.from_dict(
        {
            "backend": "oci",
            "runtime": runtime,
            "limits": {"memory_bytes": 128 << 20, "max_pids": 32},
        }
    )
    fork = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(n)\n"
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", "b = bytearray(512 << 20); print('allocated')"])
        assert r.exit_code != 0 and "MemoryError" in r.stderr, r
        r = await sb.run(["python3", "-c", fork], timeout=20)
        assert r.exit_code == 0 and int(r.stdout) < 32, r


async def test_network_none_has_loopback_only_and_a_pty_works(oci_box: Sandbox) -> None:
    r = await oci_box.run("tail -n +3 /proc/net/dev | cut -d: -f1")
    assert r.stdout.split() == ["lo"]
    sh = await oci_box.shell()
    try:
        assert (await sh.expect(r"\$ $|# $", 10)).matched
        await sh.write("echo $((6 * 7))\n")
        assert (await sh.expect("42", 10)).matched
    finally:
        await sh.close()


async def test_closing_the_box_ends_its_processes(workspace: Path, runtime: str) -> None:
    async with Sandbox(Policy(backend="oci", runtime=runtime), workspace=workspace) as sb:
        await sb.run("sleep 61.4321 > /dev/null 2>&1 &")
        fd = os.pidfd_open(_init_pid(sb))
    try:
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        loop.add_reader(fd, gone.set_result, None)
        async with asyncio.timeout(10):
            await gone  # readable: the agent (the box's pid 1) has exited
        loop.remove_reader(fd)
    finally:
        os.close(fd)
    for entry in Path("/proc").iterdir():  # nothing of the box's is left running
        if entry.name.isdigit():
            try:
                assert b"sleep\x0061.4321" not in (entry / "cmdline").read_bytes()
            except OSError:
                continue


async def test_runsc_is_refused_with_the_fix(workspace: Path) -> None:
    with pytest.raises(BackendUnavailable, match="runtime 'crun' or 'runc'"):
        async with Sandbox(Policy(backend="oci", runtime="runsc"), workspace=workspace):
            pass


OWNER = """
import asyncio, json, sys
from corral import Policy, Sandbox

async def main():
    sb = Sandbox(Policy(backend="oci", runtime=sys.argv[1]), workspace=sys.argv[2])
    await sb.start()
    await sb.spawn("sleep 62.4321")
    print(json.dumps({"id": sb.sandbox_id, "init": sb._box.init_pid}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_box_whose_owner_died_is_swept_by_the_next_start(
    workspace: Path, runtime: str
) -> None:
    """The box ends with its owner (its channel closes), and the next start removes what
    the box and its runtime kept on the host."""
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, runtime, str(workspace), stdout=asyncio.subprocess.PIPE
    )
    assert owner.stdout is not None
    async with asyncio.timeout(60):
        facts = json.loads(await owner.stdout.readline())
    fd = os.pidfd_open(facts["init"])
    owner.kill()
    await owner.wait()
    try:
        async with Sandbox(Policy(backend="oci", runtime=runtime), workspace=workspace) as sb:
            assert (await sb.run("echo ok")).stdout == "ok\n"
        ready, _, _ = select.select([fd], [], [], 10)
        assert ready, "the orphaned box still runs"
    finally:
        os.close(fd)
    assert not (state_root() / "boxes" / facts["id"]).exists()
    assert not (state_root() / "oci" / runtime / facts["id"]).exists()


async def test_stop_kills_the_box_from_the_host(workspace: Path, runtime: str) -> None:
    """What ends a hung box (no cgroup to kill): SIGKILL to its init, whose user namespace
    lies below one of the runtime's that is gone by now; the user owns both."""
    async with Sandbox(Policy(backend="oci", runtime=runtime), workspace=workspace) as sb:
        fd = os.pidfd_open(_init_pid(sb))
        try:
            assert isinstance(sb._box, OciBox)
            await asyncio.to_thread(sb._box.stop)
            ready, _, _ = await asyncio.to_thread(select.select, [fd], [], [], 10)
            assert ready, "the box's init outlived stop()"
        finally:
            os.close(fd)


async def test_allowlist_and_ports_reach_the_host_as_the_user(
    workspace: Path, runtime: str, host_server: int
) -> None:
    policy = Policy.from_dict(
        {
            "backend": "oci",
            "runtime": runtime,
            "network": {
                "mode": "allowlist",
                "allow_hosts": ["allowed.test"],
                "allow_private": ["127.0.0.1"],
            },
        }
    )
    names = StaticResolver({"allowed.test": "127.0.0.1", "denied.test": "127.0.0.1"})
    async with Sandbox(policy, workspace=workspace, resolver=names) as sb:
        r = await sb.run(f"curl -sS http://allowed.test:{host_server}/allowed", timeout=20)
        assert r.stdout == "hello /allowed\n", r.stderr
        r = await sb.run(f"curl -sS http://denied.test:{host_server}/x", timeout=20)
        assert "network.allow_hosts" in r.stdout
    ports = Policy.from_dict(
        {"backend": "oci", "runtime": runtime, "network": {"mode": "ports", "ports": [host_server]}}
    )
    async with Sandbox(ports, workspace=workspace) as sb:
        r = await sb.run(f"curl -sS http://127.0.0.1:{host_server}/port", timeout=20)
        assert r.stdout == "hello /port\n", r.stderr


async def test_full_mode_is_refused_with_the_alternatives(workspace: Path, runtime: str) -> None:
    policy = Policy.from_dict({"backend": "oci", "runtime": runtime, "network": {"mode": "full"}})
    with pytest.raises(BackendUnavailable, match="use backend 'bwrap'"):
        async with Sandbox(policy, workspace=workspace):
            pass


async def test_the_box_has_its_own_capped_pty_pool(oci_box: Sandbox) -> None:
    """The runtime's devpts takes ``max=`` in the box's user namespace (bwrap's does not):
    a box cannot drain the host's ``kernel.pty.max``."""
    r = await oci_box.run("grep ' /dev/pts ' /proc/self/mountinfo")
    assert f"max={PTY_MAX}" in r.stdout, r.stdout
