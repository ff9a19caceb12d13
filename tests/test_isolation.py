"""What the box must hold: each test tries the escape from inside and checks it failed."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import one_id_skip, rootless_skip
from corral import FilesystemPolicy, Mount, PathOutsideSandbox, Policy, PolicyError, Sandbox
from corral.errors import FilePermissionDenied

pytestmark = pytest.mark.needs_bwrap


@pytest.mark.parametrize(
    "target",
    [
        "/etc/corral-escape",
        "/usr/corral-escape",
        "/corral-escape",
        "/var/tmp/corral-escape",
        "/run/corral-escape2",
    ],
)
async def test_writes_outside_the_workspace_fail(sandbox: Sandbox, target: str) -> None:
    """Refused; /var/tmp is the box's own /tmp (a link), so a write there stays in the box."""
    r = await sandbox.run(["sh", "-c", f"echo x > {target}"])
    assert r.exit_code != 0 or target.startswith("/var/tmp/")
    assert not os.path.exists(target)


async def test_workspace_writes_land_on_the_host_owned_by_its_owner(
    sandbox: Sandbox, workspace: Path
) -> None:
    r = await sandbox.run("echo data > out.txt")
    assert r.exit_code == 0
    assert (workspace / "out.txt").read_text() == "data\n"
    assert (workspace / "out.txt").stat().st_uid == workspace.stat().st_uid


@pytest.mark.parametrize("path", ["/etc/shadow", "/root", "/etc/ssh"])
async def test_default_deny_read_paths_are_unreadable(sandbox: Sandbox, path: str) -> None:
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this host")
    r = await sandbox.run(["ls", "-A", path] if os.path.isdir(path) else ["cat", path])
    assert r.exit_code != 0
    # Masked, or (host data such as /root) not in the box at all.
    assert "Permission denied" in r.stderr or "No such file" in r.stderr, r.stderr


async def test_policy_deny_read_masks_a_workspace_file(workspace: Path) -> None:
    (workspace / ".env").write_text("TOKEN=secret\n")
    policy = Policy.from_dict({"filesystem": {"deny_read": [".env"]}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("cat .env")
        assert r.exit_code != 0 and "secret" not in r.stdout
        with pytest.raises(PathOutsideSandbox):
            await sb.files.read(".env")


async def test_deny_write_makes_a_workspace_dir_read_only(workspace: Path) -> None:
    (workspace / ".git").mkdir()
    policy = Policy.from_dict({"filesystem": {"deny_write": [".git"]}})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("echo x > .git/config")
        assert r.exit_code != 0
        assert not (workspace / ".git" / "config").exists()
        assert (await sb.run("echo y > ok.txt")).exit_code == 0


async def test_host_processes_are_invisible(sandbox: Sandbox) -> None:
    r = await sandbox.run("ls /proc | grep -E '^[0-9]+$'")
    pids = {int(x) for x in r.stdout.split()}
    if sandbox.policy.backend != "microvm":  # a VM lists its own kernel threads too
        assert max(pids) < 100  # only the box's own (1: bwrap init, 2: agent, then commands)
    r = await sandbox.run(["kill", "-0", str(os.getpid())])
    assert r.exit_code != 0
    r = await sandbox.run("cat /proc/[0-9]*/comm")
    assert "pytest" not in r.stdout and "qemu-system-x86" not in r.stdout


@one_id_skip("they can signal the agent, which ends their own box")
async def test_commands_cannot_touch_the_agent(sandbox: Sandbox) -> None:
    agent = (await sandbox.info())["agent_pid"]  # 2 under bwrap's init, 1 in an OCI box
    r = await sandbox.run(f"id -u; ls /proc/{agent}/fd; cat /proc/{agent}/environ; kill -9 {agent}")
    assert r.stdout.splitlines()[0] == "1000"
    assert r.stderr.count("Permission denied") >= 2 or "not permitted" in r.stderr
    assert (await sandbox.run("echo alive")).stdout == "alive\n"


async def test_commands_hold_no_capabilities(sandbox: Sandbox) -> None:
    r = await sandbox.run("grep -E '^Cap(Eff|Prm|Amb)' /proc/self/status")
    for line in r.stdout.splitlines():
        assert line.split()[1] == "0000000000000000", line


async def test_namespaces_cannot_be_created_inside(sandbox: Sandbox) -> None:
    r = await sandbox.run("unshare -U true; unshare -n true; unshare -m true")
    assert r.stderr.count("Operation not permitted") == 3


@pytest.fixture
def host_server() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(5)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.sendall(b"host")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
    srv.close()
    t.join(timeout=5)


async def test_network_is_absent(sandbox: Sandbox, host_server: int) -> None:
    code = (
        "import socket\n"
        "for addr in [('127.0.0.1', %d), ('1.1.1.1', 53)]:\n"
        "    s = socket.socket(); s.settimeout(2)\n"
        "    try:\n"
        "        s.connect(addr); print('CONNECTED', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
        "except OSError:\n"
        "    print('no dns')\n"
    ).replace("%d", str(host_server))
    r = await sandbox.run(["python3", "-c", code], timeout=20)
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout
    assert r.stdout.count("refused") == 2 and "no dns" in r.stdout
    links = await sandbox.run("cat /proc/net/dev")
    assert [ln.split(":")[0].strip() for ln in links.stdout.splitlines()[2:]] == ["lo"]


async def test_file_ops_refuse_traversal(sandbox: Sandbox) -> None:
    for bad in ["../etc/passwd", "a/../../x", "../../../../etc/shadow"]:
        with pytest.raises(PathOutsideSandbox):
            await sandbox.files.read(bad)


async def test_file_ops_read_an_absolute_path_as_the_box_sees_it(sandbox: Sandbox) -> None:
    """An absolute path is read in the box's own view, as a command would read it (the
    box's passwd, not the host's), and writing there stays refused."""
    seen = await sandbox.run("cat /etc/passwd")
    assert (await sandbox.files.read("/etc/passwd")).decode() == seen.stdout
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.write("/etc/corral-test", "x")


async def test_file_ops_refuse_symlinks_that_point_out(sandbox: Sandbox) -> None:
    await sandbox.run("ln -s /etc evil; ln -s ../../etc/passwd link; mkdir d; ln -s / d/up")
    for path in ["evil/passwd", "link", "d/up/etc/hostname"]:
        with pytest.raises(PathOutsideSandbox):
            await sandbox.files.read(path)
    with pytest.raises(PathOutsideSandbox):
        await sandbox.files.write("evil/owned", "x")
    assert not os.path.exists("/etc/owned")


async def test_symlink_inside_the_workspace_is_followed(sandbox: Sandbox) -> None:
    await sandbox.files.write("real.txt", "content")
    await sandbox.run("ln -s real.txt alias")
    assert await sandbox.files.read("alias") == b"content"


async def test_file_ops_respect_read_only_mounts(workspace: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "f").write_text("ro")
    policy = Policy.from_dict({"filesystem": {"mounts": [{"host": str(data), "guest": "/data"}]}})
    async with Sandbox(policy, workspace=workspace) as sb:
        assert await sb.files.read("/data/f") == b"ro"
        with pytest.raises(FilePermissionDenied):
            await sb.files.write("/data/f", "rw")
    assert (data / "f").read_text() == "ro"


async def test_a_nested_mount_is_reachable_by_commands(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "f").write_text("shared")
    mount = Mount(host=data, guest="/data/deep/shared")
    policy = box_policy.model_copy(update={"filesystem": FilesystemPolicy(mounts=(mount,))})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("cat /data/deep/shared/f; stat -c %a /data /data/deep")
        assert r.stdout == "shared755\n755\n", r.stderr


@rootless_skip(
    "an ordinary user cannot own a root-owned directory nor idmap a share: a rootless rw "
    "share is the user's own directory, written as the user"
)
async def test_a_read_write_mount_of_a_root_owned_dir_is_the_box_users(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    """The box user writes an ``rw`` share of a host directory root owns (issue 14: the
    microVM could not); what it creates is root's on the host, never a stranger's."""
    data = tmp_path / "rootdata"
    data.mkdir(mode=0o755)
    assert data.stat().st_uid == 0  # the tests run as root
    mount = Mount(host=data, guest="/data", mode="rw")
    policy = box_policy.model_copy(update={"filesystem": FilesystemPolicy(mounts=(mount,))})
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run("echo made > /data/f && stat -c '%u %a' /data /data/f")
        assert (r.exit_code, r.stdout) == (0, "1000 755\n1000 644\n"), r.stderr
    made = data / "f"
    assert made.read_text() == "made\n" and (made.stat().st_uid, made.stat().st_gid) == (0, 0)


async def test_a_mount_inside_a_read_only_host_dir_is_a_clear_policy_error(
    box_policy: Policy, workspace: Path
) -> None:
    mount = Mount(host=Path("/tmp"), guest="/usr/x/y")
    policy = box_policy.model_copy(update={"filesystem": FilesystemPolicy(mounts=(mount,))})
    if box_policy.backend == "microvm":  # the VM's root is a writable overlay: no problem there
        async with Sandbox(policy, workspace=workspace) as sb:
            assert (await sb.run(["test", "-d", "/usr/x/y"])).exit_code == 0
        return
    with pytest.raises(PolicyError, match="create /usr/x/y on the host"):
        async with Sandbox(policy, workspace=workspace):
            pass


async def test_minimal_root_runs_sh_python_and_node_but_hides_the_host(workspace: Path) -> None:
    policy = Policy.from_dict({"filesystem": {"inherit_readable": False}})
    async with Sandbox(policy, workspace=workspace) as sb:
        assert (await sb.run("echo sh-ok")).stdout == "sh-ok\n"
        assert (await sb.run(["python3", "-c", "print('py-ok')"])).stdout == "py-ok\n"
        node = await sb.run(["node", "-e", "console.log('node-ok')"])
        assert node.stdout == "node-ok\n", node.stderr
        r = await sb.run("ls /; test -e /etc/hostname || echo no-hostname; whoami")
        top = set(r.stdout.split())
        assert {"usr", "etc", "workspace", "tmp"} <= top
        assert "opt" not in top and "srv" not in top and "var" not in top
        assert "no-hostname" in top and "user" in top
