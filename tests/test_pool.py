"""The warm pool: workspaces bound into running boxes, nothing leaked, nothing deleted."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import dead_pid
from corral import Policy, Sandbox, SandboxError
from corral.backends.host import mounts, staging
from corral.pool import SandboxPool, needs_fresh_box

pytestmark = pytest.mark.needs_bwrap


def _pool_mounts() -> list[str]:
    """Staging mounts of this test process (other processes may run pools at the same time)."""
    root = str(staging.pool_root()) + "/"
    ours = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split(" ")[4]
        if not target.startswith(root):
            continue
        entry = Path(target).parent
        try:
            owner = json.loads((entry / "owner.json").read_text())["host_pid"]
        except (OSError, ValueError, KeyError):
            owner = os.getpid()  # no owner file left: only a broken release does that
        if owner == os.getpid():
            ours.append(target)
    return ours


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(size=1) as p:
        yield p
    assert not _pool_mounts()


async def test_one_shot_sees_and_writes_the_workspace(pool: SandboxPool, workspace: Path) -> None:
    (workspace / "in.txt").write_text("from the host\n")
    r = await pool.run("cat in.txt && echo out > out.txt && pwd", workspace=workspace)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "from the host\n/workspace\n"
    out = workspace / "out.txt"
    assert out.read_text() == "out\n"
    assert (out.stat().st_uid, out.stat().st_gid) == (os.getuid(), os.getgid())


async def test_claims_do_not_see_each_others_workspaces(pool: SandboxPool, tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "secret").write_text("a's file")
    assert (await pool.run("ls -A", workspace=first)).stdout == "secret\n"
    await pool.wait_idle()
    r = await pool.run("ls -A; cat /workspace/secret", workspace=second)
    assert r.stdout == "" and "No such file" in r.stderr
    assert (first / "secret").read_text() == "a's file"


async def test_nothing_runs_after_a_one_shot_returns(pool: SandboxPool, workspace: Path) -> None:
    # A daemon keeps appending to a file in the workspace; once run() returns it must never
    # write again, because the box was stopped before the workspace was handed back.
    script = "(while :; do echo x >> tick; done) & until [ -s tick ]; do :; done; echo up"
    r = await pool.run(["sh", "-c", script], workspace=workspace)
    assert r.stdout == "up\n"
    size = (workspace / "tick").stat().st_size
    await pool.wait_idle()  # the box is gone: every process has exited
    assert (workspace / "tick").stat().st_size == size


async def test_session_from_the_pool_keeps_state(pool: SandboxPool, workspace: Path) -> None:
    sb = await pool.sandbox(workspace)
    async with sb:
        assert sb.workspace == workspace
        await sb.files.write("note.txt", "kept")
        assert (await sb.run("cat note.txt")).stdout == "kept"
    assert (workspace / "note.txt").read_text() == "kept"
    assert sb.closed


async def test_without_workspace_a_temporary_one_is_made_and_removed(pool: SandboxPool) -> None:
    sb = await pool.sandbox()
    async with sb:
        assert sb.workspace is not None
        made = sb.workspace
        assert made.is_dir() and not mounts.is_mountpoint(str(made))
    assert not made.exists()


async def test_another_owners_workspace_is_served_warm_and_keeps_its_owner(
    pool: SandboxPool, tmp_path: Path
) -> None:
    ws = tmp_path / "other"
    ws.mkdir()
    (ws / "theirs").write_text("x")
    os.chown(ws / "theirs", 4321, 4321)
    os.chown(ws, 4321, 4321)
    sb = await pool.sandbox(ws)
    async with sb:
        assert sb._workspace_arg != ws  # a pooled box: the workspace was idmapped into it
        r = await sb.run("echo more >> theirs && touch made-by-box && stat -c %u theirs")
        assert r.stdout == "1000\n", r.stderr
    assert (ws / "made-by-box").stat().st_uid == 4321
    assert (ws / "theirs").read_text() == "xmore\n"


async def test_workspace_relative_deny_entries_are_never_pooled(workspace: Path) -> None:
    policy = Policy(filesystem={"deny_write": (".git",)})
    assert "applied when a box starts" in (needs_fresh_box(policy) or "")
    (workspace / ".git").mkdir()
    staged = set(staging.pool_root().iterdir()) if staging.pool_root().is_dir() else set()
    async with SandboxPool(policy, size=1) as pool:
        assert pool.ready == 0
        r = await pool.run("touch .git/x", workspace=workspace)
    assert r.exit_code != 0 and not (workspace / ".git" / "x").exists()
    # The deny entry's mount point, made in the staging directory before the workspace was
    # mounted there, does not keep the staging directory from being removed.
    assert set(staging.pool_root().iterdir()) - staged == set()


async def test_bad_input_is_refused_clearly(pool: SandboxPool, tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="not a directory"):
        await pool.run("true", workspace=tmp_path / "missing")
    with pytest.raises(SandboxError, match="at least 1"):
        SandboxPool(size=0)


async def test_close_leaves_no_box_or_mount(workspace: Path) -> None:
    async with SandboxPool(size=2) as pool:
        ids = [sb.sandbox_id for sb in pool._ready]
        await pool.run("true", workspace=workspace)
    assert not _pool_mounts()
    assert not any((staging.pool_root() / name).exists() for name in ids)
    for sid in ids:
        assert not (Path("/run/corral/boxes") / sid).exists()


def test_sweep_unmounts_a_dead_owners_staging_and_keeps_the_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    ws = tmp_path / "precious"
    ws.mkdir()
    (ws / "data").write_text("keep me")
    entry = staging.pool_root() / "cb-dead"
    (entry / "ws").mkdir(parents=True)
    dead = dead_pid()
    (entry / "owner.json").write_text(json.dumps({"host_pid": dead}))
    mounts.bind(str(entry / "ws"), str(entry / "ws"), recursive=False)
    mounts.make_shared(str(entry / "ws"))
    mounts.bind(str(ws), str(entry / "ws"))
    assert (entry / "ws" / "data").exists()
    assert staging.sweep_staging() == ["cb-dead"]
    assert not entry.exists() and not _pool_mounts()
    assert (ws / "data").read_text() == "keep me"


def test_sweep_leaves_a_live_owners_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    entry = staging.pool_root() / "cb-live"
    (entry / "ws").mkdir(parents=True)
    (entry / "owner.json").write_text(json.dumps({"host_pid": os.getpid()}))
    assert staging.sweep_staging() == []
    assert entry.exists()


async def test_one_shot_claims_a_started_box_and_refills_after(workspace: Path) -> None:
    async with SandboxPool(size=1) as pool:
        started = []
        real_make = pool._make

        async def counting_make() -> Sandbox:
            started.append(time.monotonic())
            return await real_make()

        pool._make = counting_make  # type: ignore[method-assign]
        await pool.run("true", workspace=workspace)
        assert started == []  # claimed a ready box; the refill is only scheduled
        await pool.wait_idle()
        assert len(started) == 1


async def test_a_mount_behind_a_private_directory_reaches_pooled_boxes(
    workspace: Path, tmp_path: Path
) -> None:
    """A shared path under a directory only root may enter (a preset's toolchain in
    /root/.pyenv, say) is idmapped for a pooled box as for a fresh one: the box's owner uid,
    which runs bwrap, could not reach it by its host path."""
    private = tmp_path / "private"
    tool = private / "tool"
    tool.mkdir(parents=True)
    (tool / "version").write_text("1.2.3\n")
    private.chmod(0o700)
    policy = Policy.from_dict(
        {"filesystem": {"mounts": [{"host": str(tool), "guest": "/data/tool", "mode": "ro"}]}}
    )
    assert needs_fresh_box(policy) is None
    async with SandboxPool(policy, size=1) as pool:
        r = await pool.run("cat /data/tool/version", workspace=workspace)
        assert (r.exit_code, r.stdout) == (0, "1.2.3\n"), r.stderr
    assert not _pool_mounts()


@pytest.mark.parametrize("turns", [1, 2, 5])
async def test_a_cancelled_claim_gives_its_box_back_to_the_pool(
    workspace: Path, turns: int
) -> None:
    """A claim cancelled after it took a ready box refills the pool as a finished one-shot
    does: the pool held one box less for good, and wait_idle() waited for nothing."""
    import asyncio

    async with SandboxPool(size=2) as pool:
        await pool.wait_idle()
        claim = asyncio.create_task(pool.run(["true"], workspace=workspace))
        for _ in range(turns):  # the claim has taken its box, it is attaching the workspace
            await asyncio.sleep(0)
        claim.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await claim
        await pool.wait_idle(timeout=30)  # TimeoutError when the pool stayed short
        assert pool.ready == 2
    assert not _pool_mounts()
