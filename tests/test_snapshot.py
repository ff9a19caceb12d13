"""Snapshots and fork: a box's writable root becomes an image others start from; forks
diverge; the box snapshotted goes on; filesystem state only."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from corral import Policy, Sandbox, SandboxError
from corral.backends.host.state import state_root
from corral.images.store import ImageStore
from oci_images import busybox_root, dir_tar, write_layout

pytestmark = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="writable image roots run on bwrap as root"),
]


@pytest.fixture
def image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = busybox_root(tmp_path / "rootfs")
    (root / "etc").mkdir(exist_ok=True)
    write_layout(tmp_path / "layout", [dir_tar(root)])
    return str(tmp_path / "layout")


async def test_a_snapshot_restores_and_forks_diverge(image: str, tmp_path: Path) -> None:
    policy = Policy(image=image, user="root")
    (tmp_path / "ws0").mkdir()
    async with Sandbox(policy, workspace=tmp_path / "ws0") as sb:
        await sb.run("echo configured > /etc/app.conf && mkdir -p /data && echo 1 > /data/n")
        ref = await sb.snapshot("localhost/corral-test/snap:1")
        assert not sb.paused  # it went on after the snapshot
        assert (await sb.run("echo after > /etc/later && cat /etc/app.conf")).exit_code == 0
        async with Sandbox.restore(ref, policy) as restored:
            r = await restored.run("cat /etc/app.conf /data/n; ls /etc")
            assert r.stdout.startswith("configured\n1\n"), r
            assert "later" not in r.stdout  # written after the snapshot
        forks = await sb.fork(2)
        try:
            for i, fork in enumerate(forks):
                await fork.run(f"echo fork{i} > /data/mine")
            seen = [(await f.run("cat /data/mine /etc/app.conf")).stdout for f in forks]
            assert seen == ["fork0\nconfigured\n", "fork1\nconfigured\n"]
            assert (await sb.run("cat /data/mine 2>&1 || echo none")).stdout.endswith("none\n")
        finally:
            for fork in forks:
                await fork.aclose()


async def test_a_snapshot_needs_an_image_of_the_store(tmp_path: Path) -> None:
    async with Sandbox(workspace=tmp_path) as sb:  # the host's root: nothing to snapshot
        with pytest.raises(SandboxError):
            await sb.snapshot("localhost/corral-test/nothing:1")


async def test_snapshot_and_fork_through_the_server(image: str, tmp_path: Path) -> None:
    import corral
    from served import serving

    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        async with corral.connect(served.url) as remote:
            async with remote.Sandbox(Policy(image=image, user="root")) as sb:
                await sb.run("echo base > /etc/state")
                forks = await sb.fork(2)
                for i, fork in enumerate(forks):
                    await fork.run(f"echo fork{i} >> /etc/state")
                states = [(await f.run("cat /etc/state")).stdout for f in forks]
                assert states == ["base\nfork0\n", "base\nfork1\n"]
                ref = await sb.snapshot("localhost/corral-test/remote:1")
                assert ref == "localhost/corral-test/remote:1" and ref.warnings == ()
                await sb.run("echo mine > /workspace/w && (sleep 1000 >/dev/null 2>&1 &)")
                with pytest.raises(corral.ProcessStateUnavailable, match="criu"):
                    await sb.snapshot("localhost/corral-test/remote:2", processes="error")
                snap = await sb.snapshot("localhost/corral-test/remote:2", workspace=True)
                assert snap.processes == 1 and snap.workspace, snap.to_dict()
                assert "filesystem-only" in snap.warnings[0]
                (fork,) = await sb.fork(1, workspace=True)
                assert any("filesystem-only" in w for w in fork.warnings)
                assert (await fork.run("cat /workspace/w")).stdout == "mine\n"
                forks.append(fork)
                corral_cli = [sys.executable, "-m", "corral"]
                cli = functools.partial(
                    subprocess.run, env=served.env, capture_output=True, text=True, timeout=120
                )
                done = cli([*corral_cli, "snapshot", sb.id, "localhost/corral-test/cli:1"])
                assert done.returncode == 0, done
                assert done.stdout == "localhost/corral-test/cli:1\n"
                assert "corral: warning: filesystem-only snapshot: 1 process" in done.stderr
                done = cli([*corral_cli, "snapshot", sb.id, "x/y:1", "--processes", "error"])
                assert done.returncode == 125 and "process_state_unavailable" in done.stderr, done
                done = cli([*corral_cli, "fork", sb.id, "-n", "2", "--workspace"])
                assert done.returncode == 0 and "warning: filesystem-only" in done.stderr, done
                for box_id in done.stdout.split():
                    r = cli([*corral_cli, "exec", box_id, "--", "cat", "/workspace/w"])
                    assert r.stdout == "mine\n", r
                    assert cli([*corral_cli, "rm", box_id]).returncode == 0
                for fork in forks:
                    await fork.aclose()
            assert await remote.boxes() == []


async def test_a_hostile_writable_root_is_snapshotted_safely(image: str, tmp_path: Path) -> None:
    """Everything in the upper is the box's: a link to the host's /etc/shadow stays a link,
    setuid bits (which the box cannot set anyway) are not kept, no device node reaches the store."""
    (tmp_path / "ws").mkdir()
    async with Sandbox(Policy(image=image, user="root"), workspace=tmp_path / "ws") as sb:
        r = await sb.run(
            "ln -s /etc/shadow /etc/evil && mkfifo /etc/fifo && echo x > /etc/suid"
            " && (chmod 4755 /etc/suid; mknod /etc/dev c 1 3; true)"
        )
        assert r.exit_code == 0, r
        ref = await sb.snapshot("localhost/corral-test/hostile:1")
    store = ImageStore()
    record = store.get(ref)
    assert record is not None
    if record.cow:  # kept in the copy-on-write store: made plain (exported) on demand
        record = store.materialize(record)
    etc = store.rootfs(record) / "etc"
    assert os.readlink(etc / "evil") == "/etc/shadow"  # copied as a link, never followed
    assert stat.S_IMODE((etc / "suid").lstat().st_mode) & (stat.S_ISUID | stat.S_ISGID) == 0
    for entry in etc.iterdir():
        mode = entry.lstat().st_mode
        assert not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)), entry


async def test_three_forks_of_a_box_with_a_running_process_diverge(
    image: str, tmp_path: Path
) -> None:
    """The hidden check's shape: files in the root and the workspace, a process running;
    a filesystem-only snapshot with a warning (or the error, as chosen); three forks, each
    changing its root and workspace apart from the others and from the parent."""
    from corral import ProcessStateUnavailable

    ws = tmp_path / "ws"
    ws.mkdir()
    async with Sandbox(Policy(image=image, user="root"), workspace=ws) as sb:
        r = await sb.run(
            "echo base > /etc/state && mkdir -p /workspace/src && echo ws > /workspace/src/f"
            " && ln -s /etc/shadow /workspace/link && mkfifo /workspace/fifo"
            " && ln /workspace/src/f /workspace/hard && echo x > /workspace/suid"
            " && (sleep 1000 >/dev/null 2>&1 &)"
        )
        assert r.exit_code == 0, r
        (ws / "suid").chmod(0o4755)  # the box may not (seccomp); a host process might
        with pytest.raises(ProcessStateUnavailable) as caught:
            await sb.fork(3, processes="error", workspace=True)
        assert caught.value.code == "process_state_unavailable"
        assert "1 process besides the guest agent was running" in caught.value.message
        assert "criu" in caught.value.message.lower()
        assert not sb.paused
        forks = await sb.fork(3, workspace=True)  # processes="warn": the default
        try:
            for fork in forks:
                assert any("filesystem-only snapshot" in w for w in fork.warnings), fork.warnings
            for i, fork in enumerate(forks):
                r = await fork.run(
                    f"echo fork{i} >> /etc/state && echo fork{i} > /workspace/src/f"
                    f" && touch /workspace/mine{i} && rm /workspace/link"
                )
                assert r.exit_code == 0, r
            for i, fork in enumerate(forks):
                r = await fork.run(
                    "cat /etc/state /workspace/src/f; ls /workspace; busybox ps -o args"
                )
                lines = r.stdout.splitlines()
                assert lines[:3] == ["base", f"fork{i}", f"fork{i}"], r
                assert f"mine{i}" in lines and not {f"mine{j}" for j in range(3) if j != i} & set(
                    lines
                ), r
                assert "busybox ps -o args" in r.stdout  # ps ran, and saw no sleep:
                assert not any("sleep 1000" in line for line in lines)  # processes not kept
                host = fork.workspace
                assert host is not None and host != ws
                assert (host / "hard").read_text() == f"fork{i}\n"  # the hard link kept
                assert stat.S_ISFIFO((host / "fifo").lstat().st_mode)
                assert (host / "suid").stat().st_mode & (stat.S_ISUID | stat.S_ISGID) == 0
            r = await sb.run("cat /etc/state /workspace/src/f; ls /workspace")
            assert r.stdout.splitlines()[:2] == ["base", "ws"], r  # the parent is unchanged
            assert os.readlink(ws / "link") == "/etc/shadow"
            assert not any((ws / f"mine{i}").exists() for i in range(3))
        finally:
            for fork in forks:
                await fork.aclose()
        for fork in forks:
            assert fork.workspace is not None and not fork.workspace.exists()
        # the forks' own snapshot (a generated ref) went with the last of them
        assert not [r for r in ImageStore().list() if r.ref.startswith("corral-fork.invalid/")]
        snap = await sb.snapshot("localhost/corral-test/ws:1", workspace=True)
        assert snap.processes == 1 and snap.workspace
        assert "1 process besides the guest agent was running" in snap.warnings[0]
        r = await sb.run(  # the sleep ends and is reaped (its /proc entry goes)
            "for p in /proc/[0-9]*; do grep -qx sleep $p/comm 2>/dev/null || continue;"
            " kill ${p#/proc/}; while [ -e $p ]; do :; done; done"
        )
        assert r.exit_code == 0, r
        quiet = await sb.snapshot("localhost/corral-test/quiet:1", processes="error")
        assert quiet.warnings == () and quiet.processes == 0 and not quiet.workspace
    async with Sandbox.restore(snap, Policy(image=image)) as restored:
        r = await restored.run("cat /workspace/src/f; readlink /workspace/link")
        assert r.stdout == "ws\n/etc/shadow\n", r
    async with Sandbox.restore(quiet, Policy(image=image)) as restored:
        assert (await restored.run("ls /workspace")).stdout == ""  # no workspace kept


async def test_copy_on_write_forks_keep_the_root_size_and_leave_nothing(
    image: str, tmp_path: Path
) -> None:
    """On the copy-on-write store a snapshot is a subvolume snapshot: a fork starts from the
    box's upper without a copy, still capped by root_size (what the box held counts), and
    closing boxes deletes their subvolumes and staging mounts; forgetting the image deletes
    the snapshot's."""
    from corral.backends.host import cowstore

    store_root = cowstore.root()
    if store_root is None:
        pytest.skip("no copy-on-write store here (btrfs-progs, root)")
    policy = Policy(image=image, user="root", filesystem={"root_size": "8M"})
    async with Sandbox(policy) as sb:
        r = await sb.run(
            "mkdir /data && busybox dd if=/dev/zero of=/data/a bs=1M count=5 && rm /etc/hello"
            " && echo kept > /data/note",
            cwd="/",
        )
        assert r.exit_code == 0, r
        (fork,) = await sb.fork(1, name="localhost/corral-test/cow:1")
        async with fork:
            assert (store_root / "boxes" / fork.sandbox_id).is_dir()
            r = await fork.run("busybox dd if=/dev/zero of=/data/b bs=1M count=4 2>&1", cwd="/")
            assert "Disk quota exceeded" in r.stdout, r  # 5 MB held + 4 > 8
            r = await fork.run(
                "rm /data/b; busybox dd if=/dev/zero of=/data/b bs=1M count=1 && "
                "busybox du -k /data/a",
                cwd="/",
            )
            assert r.exit_code == 0 and r.stdout.split()[0] == "5120", r
        assert (await sb.run("ls /data")).stdout == "a\nnote\n"  # the fork's are its own
    ids = (sb.sandbox_id, fork.sandbox_id)
    boxes = store_root / "boxes"
    assert not [p for p in boxes.iterdir() if p.name.partition(".")[0] in ids]
    mnt = state_root() / "mnt"
    assert (
        not [p for p in mnt.iterdir() if p.name.partition(".")[0] in ids] if mnt.is_dir() else True
    )
    store = ImageStore()
    record = store.get("localhost/corral-test/cow:1")
    assert record is not None and record.cow and not record.plain
    assert (store_root / "snaps" / record.cow).is_dir()
    # A read-only root needs a plain root: the snapshot's changes are exported once
    readonly = Policy(image=record.ref, filesystem={"root_size": None})
    async with Sandbox(readonly) as ro:
        r = await ro.run("cat /data/note; ls /etc", cwd="/")
        assert r.stdout.splitlines()[0] == "kept" and "hello" not in r.stdout, r
    plain = store.get(record.ref)
    assert plain is not None and plain.plain and plain.cow == record.cow
    assert len(plain.layers) == len(record.layers) + 1
    async with Sandbox(policy.model_copy(update={"image": record.ref})) as again:
        r = await again.run("cat /data/note; ls /etc; busybox du -k /data/a", cwd="/")
        lines = r.stdout.split()  # the upper over the plain root: the same view
        assert lines[0] == "kept" and "hello" not in lines and "5120" in lines, r
    store.remove(record.ref)
    assert not (store_root / "snaps" / record.cow).exists()
    assert not (store_root / "snaps" / f"{record.cow}.json").exists()
