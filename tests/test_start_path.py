"""What a bwrap box's start does on its way to "ready", made cheaper without changing what
the box gets: each check drives a real box (or the real host function) and looks at the
result, not at the time it took."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from corral import Sandbox

pytestmark = pytest.mark.needs_bwrap


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode().split("\0") if "=" in e)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_the_agent_has_its_locale_and_bwrap_starts_without_one() -> None:
    """bwrap (and the id-dropping helper exec'd before it) start without LANG, so the helper
    loads no locale; the agent still runs with LANG=C.UTF-8 (bwrap's --setenv)."""
    async with Sandbox() as sb:
        monitor = sb._box._proc.pid  # type: ignore[union-attr]  # bwrap's outer process
        (init,) = _children(monitor)
        (agent,) = _children(init)
        assert "LANG" not in _environ(monitor)
        env = _environ(agent)
        assert env.get("LANG") == "C.UTF-8"
        assert env.get("PATH")
        # What commands get is the backend's own environment, unchanged.
        assert (await sb.run("echo $LANG")).stdout.strip() == "C.UTF-8"
        # The orphan sweep's record is written while bwrap builds the mounts (no longer
        # before it may go on), and is there once start() has returned.
        owner = json.loads((sb._box._spec.state_dir / "owner.json").read_text())  # type: ignore[union-attr]
        assert owner["bwrap_pid"] == monitor and owner["host_pid"] == os.getpid()


@pytest.mark.parametrize("user", ["user", "root"])
async def test_the_id_maps_written_through_one_proc_descriptor(user: str) -> None:
    """The maps the host writes while bwrap waits: box root -> the namespace owner (the uid
    bwrap runs as), box uid 1000 -> the commands' host uid, the rest -> the box's other
    range; gid_map the same; setgroups denied unless commands are box root."""
    from corral import Policy

    async with Sandbox(policy=Policy(user=user)) as sb:
        box = sb._box
        monitor = box._proc.pid  # type: ignore[union-attr]
        (init,) = _children(monitor)
        owner = box._owner.uid  # type: ignore[union-attr]
        shared = box._shared  # type: ignore[union-attr]
        status = Path(f"/proc/{monitor}/status").read_text()
        assert f"Uid:\t{owner}\t" in status  # bwrap runs as the namespace's owner
        uid_map = Path(f"/proc/{init}/uid_map").read_text()
        gid_map = Path(f"/proc/{init}/gid_map").read_text()
        rows = [tuple(int(v) for v in line.split()) for line in uid_map.splitlines()]
        assert (0, owner, 1) in rows
        assert any(box_id == 1000 and host == shared.uid for box_id, host, _ in rows)
        assert [line.split()[0] for line in gid_map.splitlines()] == [
            line.split()[0] for line in uid_map.splitlines()
        ]
        expected = "allow" if user == "root" else "deny"
        assert Path(f"/proc/{init}/setgroups").read_text().strip() == expected
        assert (await sb.run("id -u")).stdout.strip() == ("0" if user == "root" else "1000")


def test_peel_detaches_stacked_mounts_by_the_kernels_word(tmp_path: Path) -> None:
    """peel (a box close's staging release) unmounts until the kernel says the path is no
    mount point (EINVAL), with no read of the mount table: True for two stacked binds, a
    plain directory, a missing path; a parent's mount is never touched."""
    from corral.backends.host import mounts

    source, target = tmp_path / "src", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    (source / "mark").write_text("x")
    mounts.bind(str(source), str(target))
    mounts.bind(str(source), str(target))
    assert mounts.is_mountpoint(str(target))
    inside = target / "sub"
    (source / "sub").mkdir()
    assert mounts.peel(str(inside))  # no mount point: nothing unmounted
    assert mounts.is_mountpoint(str(target))
    assert mounts.peel(str(target))
    assert not mounts.is_mountpoint(str(target)) and not (target / "mark").exists()
    assert mounts.peel(str(target))  # again: nothing there
    assert mounts.peel(str(tmp_path / "missing"))
