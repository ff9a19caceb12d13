"""Rootless boxes, run as an ordinary user: the contract (commands, files, PTY, MCP, the CLI),
the limits without a cgroup, and escape attempts that must fail as they do in root mode."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from corral import Policy, Sandbox
from corral.backends.layout import PTY_MAX
from corral.net import StaticResolver

PROMPT = r"\$ $|# $"


async def test_a_box_starts_rootless_and_says_how(box: Sandbox, mapped: bool) -> None:
    info = await box.info()
    assert info["backend"] == "bwrap-rootless"
    cgroup = "delegated cgroup v2" if os.environ.get("CORRAL_CGROUP_DELEGATE") else "rlimits"
    assert info["rootless"] == {"ids": "subordinate" if mapped else "single", "limits": cgroup}
    unenforced = " | ".join(info["unenforced"])
    assert "limits.max_pids enforced as RLIMIT_NPROC" in unenforced
    if not mapped:
        assert "usermod --add-subuids" in unenforced  # the weaker separation, and its fix


async def test_what_commands_write_in_the_workspace_is_the_users(
    box: Sandbox, workspace: Path, mapped: bool
) -> None:
    r = await box.run("echo hi > out.txt && id -u && mkdir -p d/e && touch d/e/f")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == ("1000" if mapped else "0")
    for path in (workspace / "out.txt", workspace / "d" / "e" / "f"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert (workspace / "out.txt").read_text() == "hi\n"
    # The file tools act as the command user too.
    await box.files.write("tool.txt", "from the tool")
    assert (workspace / "tool.txt").stat().st_uid == os.getuid()
    assert await box.files.read_text("out.txt") == "hi\n"


async def test_large_files_round_trip_and_stay_the_users(box: Sandbox, workspace: Path) -> None:
    """Past 1 MiB the host moves the bytes (corral.files): as an ordinary user too."""
    blob = await asyncio.to_thread(os.urandom, (3 << 20) + 5)
    assert await box.files.write("big.bin", blob) == len(blob)
    assert await box.files.read("big.bin", max_bytes=len(blob)) == blob
    assert await asyncio.to_thread((workspace / "big.bin").read_bytes) == blob
    assert (workspace / "big.bin").stat().st_uid == os.getuid()


async def test_commands_hold_no_capability_and_cannot_touch_the_agent(
    box: Sandbox, mapped: bool
) -> None:
    r = await box.run("grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status")
    assert all(line.split()[1] == "0000000000000000" for line in r.stdout.splitlines()), r.stdout
    agent = (await box.info())["agent_pid"]
    probe = await box.run(f"kill -0 {agent} && echo reached; cat /proc/{agent}/environ")
    assert "reached" not in probe.stdout or not mapped
    assert probe.exit_code != 0  # the agent's environment is never readable (not dumpable)


@pytest.mark.parametrize(
    "attack",
    [
        "touch /usr/corral-escape",  # the host root is read-only
        "echo x > /etc/passwd",
        "mount -t tmpfs none /mnt",  # no mount: no capability, seccomp
        "unshare -r true",  # no nested user namespace
        "echo b > /proc/sysrq-trigger",
        "chmod u+s /workspace/sh-copy",  # no setuid bit on a file the box made
        "cat /etc/shadow",
        "ls /root",
        "nsenter -t 1 -m true",
        "mv /run/corral /run/moved",  # the agent's mount points stay put (/run is read-only)
        "touch /run/planted",
    ],
)
async def test_escape_attempts_fail(box: Sandbox, attack: str) -> None:
    await box.run("cp /bin/sh /workspace/sh-copy")
    r = await box.run(attack)
    assert r.exit_code != 0, (attack, r.stdout)
    if "chmod" in attack:
        mode = (await box.run("stat -c %a /workspace/sh-copy")).stdout.strip()
        assert mode in ("755", "775")


async def test_the_users_own_credentials_are_masked(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("SECRET-KEY")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("SECRET-AWS")
    monkeypatch.setenv("HOME", str(home))
    async with Sandbox(Policy(), workspace=workspace) as sb:
        r = await sb.run(f"cat {home}/.ssh/id_ed25519 {home}/.aws/credentials; ls -a {home}")
    assert "SECRET" not in r.stdout


async def test_tmp_is_private(box: Sandbox, tmp_path: Path) -> None:
    host_file = Path("/tmp") / f"corral-rootless-{os.getpid()}"
    host_file.write_text("host")
    try:
        r = await box.run(f"test -e {host_file} && echo seen; echo box > /tmp/mine; cat /tmp/mine")
        assert r.stdout == "box\n"
    finally:
        host_file.unlink()


async def test_memory_is_bounded_per_command(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"memory_bytes": 128 << 20}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", "b = bytearray(512 << 20); print('allocated')"])
        assert r.exit_code != 0 and "allocated" not in r.stdout
        assert "MemoryError" in r.stderr
        assert (await sb.run(["python3", "-c", "b = bytearray(16 << 20)"])).exit_code == 0


async def test_processes_are_bounded(workspace: Path) -> None:
    policy = Policy.from_dict({"limits": {"max_pids": 32}})
    script = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(n)\n"
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", script], timeout=20)
        assert r.exit_code == 0, r.stderr
        assert int(r.stdout) < 32


async def test_a_pids_limit_the_box_cannot_take_is_refused_by_name(workspace: Path) -> None:
    """Without a cgroup, ``max_pids`` is the commands' RLIMIT_NPROC, which the box cannot set
    above the user's own hard limit: every command is refused naming it, never run under the
    host's limit while info() reports the policy's."""
    import resource

    from corral import SandboxError

    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    if hard == resource.RLIM_INFINITY or hard >= 4194304:
        pytest.skip(f"this user's hard RLIMIT_NPROC ({hard}) is above any max_pids")
    policy = Policy.from_dict({"limits": {"max_pids": hard + 1}})
    async with Sandbox(policy, workspace=workspace) as sb:
        if (await sb.info())["limits_enforced_by"] != "rlimits":
            pytest.skip("a delegated cgroup enforces max_pids here")
        with pytest.raises(SandboxError, match=r"rlimits\.nproc.*limits\.max_pids"):
            await sb.run("true")


async def test_the_timeout_ends_a_command(box: Sandbox) -> None:
    r = await box.run("sleep 30", timeout=0.5)
    assert r.timed_out


async def test_a_pty_shell_works(box: Sandbox) -> None:
    sh = await box.shell()
    try:
        assert (await sh.expect(PROMPT, 10)).matched
        await sh.write("echo $((6 * 7))\n")
        assert (await sh.expect("42", 10)).matched
    finally:
        await sh.close()


async def test_network_none_reaches_nothing(box: Sandbox) -> None:
    r = await box.run("tail -n +3 /proc/net/dev | cut -d: -f1")  # the box's own namespace
    assert r.stdout.split() == ["lo"]


async def _gateway(sb: Sandbox) -> str:
    r = await sb.run("cat /proc/net/route")
    for line in r.stdout.splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    raise AssertionError(f"no default route in the box: {r.stdout}")


@pytest.mark.skipif(shutil.which("pasta") is None, reason="pasta is not installed (passt)")
async def test_full_mode_through_pasta_keeps_its_fence(workspace: Path, host_server: int) -> None:
    async with Sandbox(Policy.from_dict({"network": {"mode": "full"}}), workspace=workspace) as sb:
        links = (await sb.run("tail -n +3 /proc/net/dev | cut -d: -f1")).stdout.split()
        assert len(links) == 2, links  # lo and pasta's interface
        gateway = await _gateway(sb)
        r = await sb.run(f"curl -sS -m 5 http://{gateway}:{host_server}/", timeout=20)
        assert r.exit_code == 7, r.stderr  # host loopback: refused by the box's own rules
        r = await sb.run("nft flush ruleset 2>&1 || echo refused")
        assert "refused" in r.stdout  # nothing in the box can lift the fence
    allowed = Policy.from_dict({"network": {"mode": "full", "allow_private": ["127.0.0.1"]}})
    async with Sandbox(allowed, workspace=workspace) as sb:
        gateway = await _gateway(sb)
        r = await sb.run(f"curl -sS -m 5 http://{gateway}:{host_server}/gw", timeout=20)
        assert r.stdout == "hello /gw\n", r.stderr


def test_corral_run_works_rootless(workspace: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral",
            "run",
            "--workspace",
            str(workspace),
            "--",
            "sh",
            "-c",
            "echo from-the-box > made.txt; cat made.txt",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "from-the-box\n"
    assert "limits.max_pids enforced as RLIMIT_NPROC" in out.stderr  # warnings are said
    assert (workspace / "made.txt").stat().st_uid == os.getuid()


async def test_mcp_over_stdio_runs_commands_rootless(workspace: Path) -> None:
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "corral", "mcp", "--workspace", str(workspace)]
    )
    async with asyncio.timeout(60), Client(params) as client:
        result = await client.call_tool("run_command", {"command": "echo mcp > m.txt; id -u"})
        data = result.structured_content
        assert data is not None and data["exit_code"] == 0, data
    assert (workspace / "m.txt").read_text() == "mcp\n"


def test_corral_doctor_explains_rootless_mode(mapped: bool) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "corral", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["rootless ids"]["ok"] is mapped
    if not mapped:
        assert "usermod --add-subuids" in checks["rootless ids"]["fix"]
    assert "RLIMIT_NPROC" in checks["rootless limits"]["detail"]
    assert checks["sandbox"]["ok"], checks["sandbox"]
    # Every difference from root mode has its line, and no root-only check reads as broken.
    differences = checks["rootless differences"]["detail"]
    for what in ("no warm pool", "not idmapped", "kernel quotas", "PTY pool", "workspace_size"):
        assert what in differences, (what, differences)
    assert "bwrap's pid 1" in differences
    for name in ("idmapped mounts", "cgroups"):
        assert checks[name]["ok"] and checks[name]["detail"].startswith("rootless: "), name
    assert "rootless too" in checks["landlock"]["detail"]
    full = checks["network full"]
    assert not full["ok"] or "pasta runs as you" in full["detail"], full
    assert checks["microvm: jail"]["detail"].startswith("rootless: qemu runs as you")
    for runtime in ("crun", "runc"):  # the oci backend runs rootless too, and says how
        assert checks[runtime]["ok"], checks[runtime]
        assert "rootless: " in checks[runtime]["detail"]
        assert ("your first subordinate id" in checks[runtime]["detail"]) is mapped
    assert "run corral as root for gVisor" in checks["runsc"]["detail"]


async def test_allowlist_proxy_runs_as_the_user(workspace: Path, host_server: int) -> None:
    policy = Policy.from_dict(
        {
            "network": {
                "mode": "allowlist",
                "allow_hosts": ["allowed.test"],
                "allow_private": ["127.0.0.1"],
            }
        }
    )
    names = StaticResolver({"allowed.test": "127.0.0.1", "denied.test": "127.0.0.1"})
    async with Sandbox(policy, workspace=workspace, resolver=names) as sb:
        r = await sb.run(f"curl -sS http://allowed.test:{host_server}/allowed", timeout=20)
        assert r.stdout == "hello /allowed\n", r.stderr
        r = await sb.run(f"curl -sS http://denied.test:{host_server}/x", timeout=20)
        assert "network.allow_hosts" in r.stdout


async def test_ports_mode_reaches_a_host_port(workspace: Path, host_server: int) -> None:
    policy = Policy.from_dict({"network": {"mode": "ports", "ports": [host_server]}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(f"curl -sS http://127.0.0.1:{host_server}/port", timeout=20)
        assert r.stdout == "hello /port\n", r.stderr


@pytest.mark.skipif(
    not os.environ.get("CORRAL_CGROUP_DELEGATE"),
    reason="no delegated cgroup v2 subtree (tests/test_rootless.py makes one where it can)",
)
async def test_a_delegated_cgroup_holds_each_box(workspace: Path) -> None:
    root = Path(os.environ["CORRAL_CGROUP_DELEGATE"])
    oci = [Policy(backend="oci", runtime=r) for r in ("crun", "runc")]
    for policy, own in ((Policy(), 2), (oci[0], 1), (oci[1], 1)):
        await _held_by_its_group(root, policy, own, workspace)


async def _held_by_its_group(root: Path, policy: Policy, own: int, workspace: Path) -> None:
    """``own``: the box's processes before any command (bwrap's init and the agent; an OCI
    box's agent alone: the runtime is gone)."""
    async with Sandbox(policy, workspace=workspace) as sb:
        info = await sb.info()
        assert info["rootless"]["limits"] == "delegated cgroup v2"
        group = root / "corral" / info["sandbox_id"]
        await sb.run("sleep 30 &")  # the box's processes are in its group, the agent's too
        pids = (group / "cgroup.procs").read_text().split()
        assert len(pids) >= own + 1, pids
        offered = set((root / "cgroup.controllers").read_text().split()) & {"memory", "pids"}
        if not offered:  # a hybrid host's v2 hierarchy: the limits are rlimits, said so
            assert info["limits_enforced_by"] == "rlimits"
            assert any("RLIMIT_NPROC" in w for w in info["unenforced"])
    assert not group.exists()  # removed with the box, its processes killed


async def test_landlock_is_enforced_rootless(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second layer holds rootless too: a directory mounted read-write that the rules
    (from the intended layout) leave out is denied; the workspace stays writable."""
    from corral.backends import landlock
    from corral.backends.bwrap import rootless
    from corral.policy import Mount

    abi, why = landlock.host_abi()
    if abi < 2:
        pytest.skip(f"no Landlock ABI 2+ here: {why}")
    stray = tmp_path / "stray"
    stray.mkdir()

    def without_stray(
        policy: Policy, python: str, extra: object = (), **kw: bool
    ) -> dict[str, object]:
        rules = landlock.rules(policy, python, extra, **kw)  # type: ignore[arg-type]
        rules["write"] = [p for p in rules["write"] if p != "/stray"]
        return rules

    monkeypatch.setattr(rootless, "landlock_rules", without_stray)
    policy = Policy(filesystem={"mounts": [Mount(host=stray, guest="/stray", mode="rw")]})
    async with Sandbox(policy, workspace=workspace) as sb:
        info = await sb.info()
        assert info["landlock"]["enforced"] is True and info["landlock"]["abi"] == abi
        r = await sb.run("echo x > /stray/f; echo w > /workspace/w && cat /workspace/w")
        assert "Permission denied" in r.stderr and r.stdout == "w\n", r
    assert not (stray / "f").exists()


@pytest.mark.slow
async def test_a_microvm_runs_rootless(workspace: Path) -> None:
    """qemu needs no privilege under TCG: as an ordinary user it runs as that user, jailed
    in a user namespace; what the VM writes in the workspace is the user's; the box says
    what it lacks (qemu's host cgroup) and commands still hold no capability."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86 is not installed")
    async with Sandbox(Policy(backend="microvm"), workspace=workspace) as sb:
        r = await sb.run("id -u && echo vm > vm.txt && grep -E '^Cap(Prm|Eff)' /proc/self/status")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "1000"
        assert all(line.split()[1] == "0000000000000000" for line in lines[1:]), r.stdout
        st = (workspace / "vm.txt").stat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
        info = await sb.info()
        assert info["backend"] == "microvm" and info["rootless"] is True
        assert any("rootless: qemu runs as you" in w for w in info["unenforced"]), info
        qemu = info["qemu_pid"]
        assert Path(f"/proc/{qemu}/status").read_text().count(f"\t{os.getuid()}\t") >= 1
    comm = Path(f"/proc/{qemu}/comm")
    assert not comm.exists() or "qemu" not in comm.read_text()  # gone (or the pid reused)


async def test_the_box_has_its_own_capped_pty_pool(box: Sandbox) -> None:
    """As in root mode: the box's devpts takes ``max=`` (mounted through the box's user
    namespace), so a box cannot drain the host's ``kernel.pty.max``; commands cannot lift it."""
    r = await box.run("grep ' /dev/pts ' /proc/self/mountinfo")
    assert f"max={PTY_MAX}" in r.stdout, r.stdout
    grab = (
        "import os\ntry:\n    [os.openpty() for _ in range(300)]\n"
        "except OSError as e:\n    print(e.errno)"
    )
    r = await box.run(["python3", "-c", grab])
    assert r.stdout.strip() == "28", r  # ENOSPC at the cap, not the host's limit
    r = await box.run("umount /dev/pts || umount -l /dev/pts")
    assert r.exit_code != 0
    sh = await box.shell()  # PTY sessions still work on it
    try:
        await sh.write("echo $((6 * 7))\n")
        assert (await sh.expect("42", 10)).matched
    finally:
        await sh.close()


async def test_bwraps_pid_1_shares_the_commands_id_and_nothing_more(box: Sandbox) -> None:
    """With subordinate ids bwrap (run by the user) is box uid 1000 in the box, as commands
    are: what SECURITY.md's rootless table says a command can and cannot do to it."""
    code = (
        "import os, errno\n"
        "def err(f):\n"
        "    try: f(); return None\n"
        "    except OSError as e: return errno.errorcode[e.errno]\n"
        "print(open('/proc/1/comm').read().strip(), bool(os.listdir('/proc/1/fd')),"
        " err(lambda: os.open('/proc/1/fd/0', os.O_RDONLY)),"
        " err(lambda: open('/proc/1/environ', 'rb').read()),"
        " err(lambda: os.open('/proc/1/mem', os.O_RDONLY)),"
        " err(lambda: os.kill(1, 15)), err(lambda: os.kill(1, 10)))"
    )
    r = await box.run(["python3", "-c", code])
    assert r.stdout.split() == ["bwrap", "True", "EACCES", "EACCES", "EACCES", "EPERM", "EPERM"]
    assert (await box.run("echo alive")).stdout == "alive\n"
