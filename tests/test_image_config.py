"""An image's config honoured by a box on it (bwrap): ``WorkingDir`` as the default cwd,
``User`` mapped to corral's box users (names read from the image's own /etc/passwd, never
through its links), ``Entrypoint`` + ``Cmd`` run by ``corral run --image REF``; the policy
wins over each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Policy, PolicyError, Sandbox
from corral.images.resolve import ImageConfig, ResolvedImage, box_user

pytestmark = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="images run on the bwrap backend as root"),
]


def _layout(tmp: Path, config: dict[str, object], passwd: str | None = None) -> str:
    from oci_images import busybox_root, dir_tar, write_layout

    root = busybox_root(tmp / "root")
    (root / "app" / "src").mkdir(parents=True)
    (root / "app" / "src" / "marker").write_text("in app\n")
    if passwd is not None:
        (root / "etc" / "passwd").write_text(passwd)
    return str(write_layout(tmp / "layout", [dir_tar(root)], config=config).path)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    return tmp_path / "store"


async def test_workingdir_is_the_default_cwd_unless_the_policy_moves_workdir(
    tmp_path: Path, store: Path
) -> None:
    ref = _layout(tmp_path, {"Env": ["PATH=/bin"], "WorkingDir": "/app"})
    async with Sandbox(Policy(image=ref), workspace=tmp_path / "root") as sb:
        assert sb.default_cwd == "/app"
        r = await sb.run("pwd; ls /workspace/etc/hello")
        assert r.stdout == "/app\n/workspace/etc/hello\n", r  # the workspace is still there
        assert (await sb.run("pwd; cat marker", cwd="src")).stdout == "/app/src\nin app\n"
        assert (await sb.run("pwd", cwd="/workspace")).stdout == "/workspace\n"
    policy = Policy(image=ref, workdir="/work")
    async with Sandbox(policy, workspace=tmp_path / "root") as sb:
        assert (await sb.run("pwd")).stdout == "/work\n"


@pytest.mark.parametrize(
    ("user", "passwd", "expected"),
    [
        ("0", None, "0:0"),
        ("root", None, "0:0"),
        ("1000:1000", None, "1000:1000"),
        ("app", "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/app:/bin/sh\n", "1000:1000"),
        (None, None, "1000:1000"),
    ],
)
async def test_the_images_user_maps_to_a_box_user(
    tmp_path: Path, store: Path, user: str | None, passwd: str | None, expected: str
) -> None:
    config: dict[str, object] = {"Env": ["PATH=/bin"]}
    if user is not None:
        config["User"] = user
    ref = _layout(tmp_path, config, passwd)
    async with Sandbox(Policy(image=ref), workspace=tmp_path / "root") as sb:
        r = await sb.run('echo "$(id -u):$(id -g)"', cwd="/")
        assert r.stdout == expected + "\n", r
        assert sb.user == ("root" if expected == "0:0" else "user")
    # The policy wins.
    policy = Policy(image=ref, user="user")
    async with Sandbox(policy, workspace=tmp_path / "root") as sb:
        assert (await sb.run("id -u", cwd="/")).stdout == "1000\n"


@pytest.mark.parametrize(
    ("user", "passwd", "why"),
    [
        ("postgres", "postgres:x:999:999::/:/bin/sh\n", "uid 999"),
        ("nosuch", None, "not in its /etc/passwd"),
        ("1000:5", None, "uid 1000, gid 5"),
        ("65534", None, "uid 65534"),
    ],
)
async def test_an_image_user_that_maps_to_no_box_user_is_refused_clearly(
    tmp_path: Path, store: Path, user: str, passwd: str | None, why: str
) -> None:
    ref = _layout(tmp_path, {"Env": ["PATH=/bin"], "User": user}, passwd)
    with pytest.raises(PolicyError, match=rf"User '{user}' \({why}.*set the policy's user"):
        async with Sandbox(Policy(image=ref), workspace=tmp_path / "root"):
            pass
    async with Sandbox(Policy(image=ref, user="root"), workspace=tmp_path / "root") as sb:
        assert (await sb.run("id -u", cwd="/")).stdout == "0\n"


def test_the_image_passwd_is_read_without_following_its_links(tmp_path: Path) -> None:
    """A hostile image's /etc/passwd (a link to the host's, a FIFO) is never read."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    host_passwd = tmp_path / "host-passwd"
    host_passwd.write_text("app:x:1000:1000::/:/bin/sh\n")
    (root / "etc" / "passwd").symlink_to(host_passwd)
    image = ResolvedImage("x", root, ImageConfig(user="app"))
    with pytest.raises(PolicyError, match="not in its /etc/passwd"):
        box_user(image, None)
    (root / "etc" / "passwd").unlink()
    os.mkfifo(root / "etc" / "passwd")  # would hang a plain open
    with pytest.raises(PolicyError, match="not in its /etc/passwd"):
        box_user(image, None)
    (root / "etc" / "passwd").unlink()
    (root / "etc").rmdir()
    (root / "etc").symlink_to(tmp_path)  # a linked directory on the way
    with pytest.raises(PolicyError, match="not in its /etc/passwd"):
        box_user(image, None)


def test_corral_run_runs_the_images_entrypoint_and_cmd(tmp_path: Path, store: Path) -> None:
    config: dict[str, object] = {
        "Env": ["PATH=/bin"],
        "Entrypoint": ["/bin/echo", "entry"],
        "Cmd": ["cmd-arg"],
    }
    ref = _layout(tmp_path, config)
    argv = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(tmp_path / "root")]
    env = {**os.environ, "CORRAL_IMAGE_STORE": str(store)}
    r = subprocess.run(
        [*argv, "--image", ref], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0 and r.stdout == "entry cmd-arg\n", r
    given = subprocess.run(
        [*argv, "--image", ref, "--", "echo", "given"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert given.stdout == "given\n", given  # a command given wins
    bare = _layout(tmp_path / "bare", {"Env": ["PATH=/bin"]})
    none = subprocess.run(
        [*argv, "--image", bare], capture_output=True, text=True, timeout=120, env=env
    )
    assert none.returncode != 0 and "names no Cmd or Entrypoint" in none.stderr, none
    assert "Traceback" not in none.stderr


@pytest.mark.parametrize("backend", ["bwrap", "oci-runc"])
async def test_box_root_commands_hold_nothing_over_the_host(backend: str, tmp_path: Path) -> None:
    """``user = "root"``: box uid 0 with capabilities over the box's namespace only; the
    host's root stays read-only and unreadable where it is host root's, and what it writes
    in the workspace belongs to the workspace's owner on the host."""
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, 4242, 4242)
    secret = tmp_path / "secret"
    secret.write_text("host root only\n")
    secret.chmod(0o600)
    policy = backend_policy(backend, user="root", filesystem={"allow_write": [], "mounts": []})
    async with Sandbox(policy, workspace=ws) as sb:
        r = await sb.run("id -u; echo $HOME; echo hi > out; touch /usr/corral-x 2>&1; echo $?")
        assert r.stdout.splitlines()[:2] == ["0", "/root"], r
        assert r.stdout.strip().endswith("1"), r
        assert not Path("/usr/corral-x").exists()
        mounted = await sb.run(f"mount -t tmpfs x /tmp 2>&1; cat {secret} 2>&1; echo $?")
        assert mounted.stdout.strip().endswith("1"), mounted
        assert "host root only" not in mounted.stdout
    st = (ws / "out").stat()
    assert (st.st_uid, st.st_gid) == (4242, 4242)


@pytest.mark.parametrize("backend", ["microvm"])
async def test_other_backends_refuse_box_root_naming_the_field(backend: str) -> None:
    from corral import BackendUnavailable

    with pytest.raises(BackendUnavailable, match=r"policy\.user"):
        async with Sandbox(Policy(user="root", backend=backend)):
            pass


async def test_the_hosts_own_root_is_no_plain_image() -> None:
    with pytest.raises(PolicyError, match="host's own root"):
        async with Sandbox(Policy(image="/")):
            pass


@pytest.mark.parametrize("backend", ["bwrap", "oci-crun"])
async def test_box_root_boxes_have_host_ids_of_their_own(backend: str) -> None:
    """Box root may take any of its box's ids (setuid: apt's _apt is 42): in a root box they
    map to a block of host ids no other box has, so the kernel's per-uid counts of one box
    never reach another's; a box of the unprivileged user keeps the shared range, which its
    commands cannot take."""
    from corral.backends.users import HOST_UID_BASE, ID_RANGE, ROOT_BOX_ID_BASE

    def host_of(uid_map: str, box_id: int) -> int:
        for line in uid_map.splitlines():
            box, host, count = (int(x) for x in line.split())
            if box <= box_id < box + count:
                return host + box_id - box
        raise AssertionError(uid_map)

    root, user = backend_policy(backend, user="root"), backend_policy(backend)
    async with Sandbox(root) as a, Sandbox(root) as b, Sandbox(user) as c:
        maps = [(await sb.run("cat /proc/self/uid_map")).stdout for sb in (a, b, c)]
        ids = [host_of(m, 42) for m in maps]
        assert ids[0] != ids[1] and ids[2] == HOST_UID_BASE + 42, maps
        for host in ids[:2]:
            assert ROOT_BOX_ID_BASE <= host < ROOT_BOX_ID_BASE + 4096 * ID_RANGE
        r = await a.run("setpriv --reuid=42 --regid=42 --clear-groups id -u")
        assert r.stdout == "42\n", r


async def test_a_workingdir_the_image_lacks_is_made_on_a_writable_root(
    tmp_path: Path, store: Path
) -> None:
    ref = _layout(tmp_path, {"Env": ["PATH=/bin"], "WorkingDir": "/srv/task"})
    async with Sandbox(Policy(image=ref), workspace=tmp_path / "root") as sb:
        r = await sb.run("pwd; ls -lnd /srv/task")
        assert r.stdout.startswith("/srv/task\ndrwxr-xr-x") and " 0 " in r.stdout, r
    read_only = Policy(image=ref, filesystem={"root_size": None})
    async with Sandbox(read_only, workspace=tmp_path / "root") as sb:
        with pytest.raises(Exception, match="working directory /srv/task"):
            await sb.run("pwd")


@pytest.mark.parametrize("backend", ["bwrap", "oci-runc"])
async def test_box_root_cannot_reach_the_agents_channel_or_memory(backend: str) -> None:
    """Box root shares uid 0 with the guest agent: the agent is not dumpable then, so a root
    command (no CAP_SYS_PTRACE) can open neither its descriptors (the channel to the host),
    nor its environ, nor its memory."""
    async with Sandbox(backend_policy(backend, user="root")) as sb:
        agent = (await sb.run("ps -eo pid,comm | grep python3 | head -1", cwd="/")).stdout.split()
        assert agent, "the agent is not in the box's process list"
        pid = agent[0]
        r = await sb.run(
            f"for f in /proc/{pid}/fd/*; do cat $f < /dev/null; done 2>&1 | sort -u; "
            f"cat /proc/{pid}/environ 2>&1; head -c 1 /proc/{pid}/mem 2>&1; "
            f"readlink /proc/{pid}/fd/0 2>&1",
            cwd="/",
        )
        lines = r.stdout.splitlines()
        # An fd the agent closed between the glob and the cat is gone: nothing else is read.
        denied = [line for line in lines if "Permission denied" in line]
        gone = [line for line in lines if "No such file or directory" in line]
        assert denied and len(denied) + len(gone) == len(lines), r
