"""Idmapped workspaces: commands are one unprivileged host uid; the workspace is theirs."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import dead_pid, rootless_skip
from corral import BackendError, FilesystemPolicy, Policy, Sandbox
from corral.backends.host import idmap, mounts, staging
from corral.backends.host.state import state_root
from corral.backends.users import COMMAND_HOST_ID

pytestmark = pytest.mark.needs_bwrap


@pytest.fixture
def owned_workspace() -> Iterator[Path]:
    """A workspace owned by an unprivileged uid, reachable by it (pytest's tmp is 0700)."""
    top = Path(tempfile.mkdtemp(prefix="corral-idmap-"))
    top.chmod(0o755)
    ws = top / "ws"
    ws.mkdir()
    os.chown(ws, 4321, 4321)
    try:
        yield ws
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _mnt_entries(sandbox_id: str) -> list[str]:
    root = state_root() / "mnt"
    names = os.listdir(root) if root.is_dir() else []
    return [name for name in names if name.startswith(sandbox_id)]


@rootless_skip(
    "no idmapped workspace rootless (mounting one needs root): commands act as the user "
    "in it, so files of other owners are as on the host (README, Rootless)"
)
async def test_an_owners_workspace_is_the_box_users(box_policy: Policy, workspace: Path) -> None:
    os.chown(workspace, 4321, 4321)
    mine = workspace / "mine"
    mine.write_text("owner's\n")
    mine.chmod(0o600)
    os.chown(mine, 4321, 4321)
    roots = workspace / "roots"
    roots.write_text("root's\n")
    roots.chmod(0o600)
    async with Sandbox(box_policy, workspace=workspace) as sb:
        r = await sb.run(
            "cat mine && echo more >> mine && touch new && stat -c '%u %g' mine && id -u && id -g"
        )
        assert r.exit_code == 0, r.stderr
        # The box user (1000) owns the owner's files (in a microVM too: its jailed qemu is
        # the box user's host uid and exports the idmapped workspace).
        text, ids, uid, gid = r.stdout.splitlines()
        assert (text, ids) == ("owner's", f"{uid} {gid}")
        assert uid == "1000"
        denied = await sb.run("cat roots")
        assert denied.exit_code != 0 and "Permission denied" in denied.stderr
        assert _mnt_entries(sb.sandbox_id)
        sandbox_id = sb.sandbox_id
    assert (mine.read_text(), (workspace / "new").stat().st_uid) == ("owner's\nmore\n", 4321)
    assert not _mnt_entries(sandbox_id)


@rootless_skip(
    "no idmapped workspace rootless (mounting one needs root): commands act as the user "
    "in it, so files of other owners are as on the host (README, Rootless)"
)
async def test_another_users_files_in_the_workspace_can_be_removed_as_on_the_host(
    box_policy: Policy, workspace: Path
) -> None:
    """Unmapped on-disk owners made ``rm`` fail with EOVERFLOW ("Value too large for defined
    data type"); now the owner's directory decides, as on the host."""
    os.chown(workspace, 4321, 4321)
    for name in ("roots", "strangers"):
        (workspace / name).write_text("x\n")
    os.chown(workspace / "strangers", 1001, 1001)
    (workspace / "theirs").mkdir()
    (workspace / "theirs" / "f").write_text("x\n")
    os.chown(workspace / "theirs", 1001, 1001)
    async with Sandbox(box_policy, workspace=workspace) as sb:
        r = await sb.run("stat -c %u strangers; rm -f roots && mv strangers moved && rm moved")
        assert (r.exit_code, r.stdout) == (0, "65534\n"), r.stderr  # nobody, inside
        r = await sb.run("rm theirs/f; chmod 777 theirs")
        assert "Value too large" not in r.stderr and "Permission denied" in r.stderr
        assert "Operation not permitted" in r.stderr
    assert sorted(os.listdir(workspace)) == ["theirs"]
    assert (workspace / "theirs" / "f").exists()


def test_other_on_disk_ids_map_to_ids_no_box_holds() -> None:
    text = idmap.id_map_text(4321, box_root=True)
    lines = [tuple(map(int, line.split())) for line in text.splitlines()]
    assert (4321, COMMAND_HOST_ID, 1) in lines
    inside = sorted((a, a + n) for a, _, n in lines)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(inside))
    assert inside[0][0] == 0 and inside[-1][1] >= idmap.FOREIGN_COUNT
    for a, b, n in lines:
        assert b >= idmap.FOREIGN_BASE or (a, b) in ((4321, COMMAND_HOST_ID), (2_000_000,) * 2)
        assert b + n <= 2**32 - 1


async def test_allow_write_and_rw_mounts_are_idmapped_too(workspace: Path, tmp_path: Path) -> None:
    writable = tmp_path / "writable"
    writable.mkdir(mode=0o755)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    fs = FilesystemPolicy(
        allow_write=(str(writable),), mounts=({"host": shared, "guest": "/data", "mode": "rw"},)
    )
    async with Sandbox(Policy(filesystem=fs), workspace=workspace) as sb:
        r = await sb.run(f"touch {writable}/a /data/b && id -u")
        assert (r.exit_code, r.stdout) == (0, "1000\n"), r.stderr
    assert (writable / "a").stat().st_uid == os.getuid()
    assert (shared / "b").stat().st_uid == os.getuid()


async def test_without_idmapped_mounts_the_box_user_is_the_owner_and_says_so(
    owned_workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idmap, "unsupported_reason", lambda: "idmapped mounts are not available")
    workspace = owned_workspace
    async with Sandbox(Policy(), workspace=workspace) as sb:
        assert any("idmapped mounts" in w for w in sb.warnings)
        assert (await sb.run("touch made")).exit_code == 0
        assert not _mnt_entries(sb.sandbox_id)
    assert (workspace / "made").stat().st_uid == 4321


async def test_without_idmapped_mounts_a_root_owned_workspace_is_refused(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback would make the box user host root: refused, naming the cause and fix."""
    monkeypatch.setattr(idmap, "unsupported_reason", lambda: "idmapped mounts are not available")
    assert workspace.stat().st_uid == 0
    sb = Sandbox(Policy(), workspace=workspace)
    with pytest.raises(BackendError, match=r"belongs to root.*chown"):
        await sb.start()
    assert not list(workspace.iterdir())


def test_a_dead_owners_idmapped_mount_is_swept_and_its_content_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep me")
    entry = staging.new_entry("mnt", "cb-dead.0")
    idmap.mount_idmapped(str(precious), str(entry / "ws"))
    assert (entry / "ws" / "data").stat().st_uid == COMMAND_HOST_ID
    (entry / "owner.json").write_text(json.dumps({"host_pid": dead_pid()}))
    assert staging.sweep_staging() == ["cb-dead.0"]
    assert not entry.exists()
    assert (precious / "data").read_text() == "keep me"


def test_the_sweep_leaves_an_entry_another_process_is_making(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between new_entry's mkdir and its owner.json, a sweep in another process used to take
    # the entry for an orphan and remove it (the maker then failed with FileNotFoundError).
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    making = staging.new_entry("pool", "cb-making")
    (making / "owner.json").unlink()  # the moment before it is written
    abandoned = staging.new_entry("pool", "cb-abandoned")
    (abandoned / "owner.json").unlink()
    os.utime(abandoned, (time.time() - 120, time.time() - 120))  # a crash a while ago
    assert staging.sweep_staging() == ["cb-abandoned"]
    assert (making / "ws").is_dir()


async def test_a_workspace_that_cannot_be_idmapped_still_starts_and_says_why(
    owned_workspace: Path, tmp_path: Path
) -> None:
    workspace = owned_workspace
    # A mount inside the workspace that is idmapped already: the recursive idmap refuses it.
    inner = workspace / "inner"
    inner.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    idmap.mount_idmapped(str(other), str(inner))
    try:
        async with Sandbox(Policy(), workspace=workspace) as sb:
            assert any("idmapped mounts failed" in w and str(workspace) in w for w in sb.warnings)
            assert (await sb.run("touch made")).exit_code == 0
            assert not _mnt_entries(sb.sandbox_id)
        assert (workspace / "made").exists()
    finally:
        mounts.umount(str(inner))


PROBE = """
import sys
from corral.backends.host import idmap
idmap._probe = lambda: "probed"
print(idmap.unsupported_reason())
"""
"""Prints what this process takes as the answer: ``probed`` when it had to probe."""


def _answer(state: Path) -> str:
    env = {**os.environ, "CORRAL_STATE_DIR": str(state)}
    r = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@rootless_skip(
    "idmapped mounts need root; a rootless box's workspace is mapped by its own user namespace"
)
def test_the_probe_runs_once_per_boot_and_a_bad_record_is_probed_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    verdict = state / idmap.VERDICT_FILE
    env = {**os.environ, "CORRAL_STATE_DIR": str(state)}
    r = subprocess.run(  # a real probe, on this host
        [sys.executable, "-c", "from corral.backends.host import idmap; "
         "print(idmap.unsupported_reason())"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "None\n"), r.stderr
    saved = json.loads(verdict.read_text())
    assert saved["value"] is None
    assert verdict.stat().st_mode & 0o777 == 0o600
    assert _answer(state) == "None"  # the next process takes the saved answer
    assert not list(state.glob(".*"))  # no temporary file left

    saved["key"]["boot"] = "another-boot"
    verdict.write_text(json.dumps(saved))
    assert _answer(state) == "probed"  # another boot's answer is not this one's
    assert json.loads(verdict.read_text())["value"] == "probed"  # and it is replaced
    assert _answer(state) == "probed"

    wrong_type = json.dumps({"key": json.loads(verdict.read_text())["key"], "value": 3})
    for bad in (b"{not json", b'{"key": 1}', b"[]", b'{"value": 3}', wrong_type.encode()):
        verdict.write_bytes(bad)
        assert _answer(state) == "probed"
    verdict.unlink()
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(json.dumps({"key": saved["key"] | {"boot": ""}, "value": None}))
    verdict.symlink_to(elsewhere)  # a link is never followed
    assert _answer(state) == "probed"
    assert not verdict.is_symlink()  # replaced by a file of its own
    assert elsewhere.read_text().startswith('{"key"')  # the link's target untouched
