"""A box's own temporary workspace when its host process dies hard.

``Sandbox()`` without a workspace makes a ``corral-ws-*`` directory and removes it when the box
closes. A SIGKILLed host never closes it: the next start's sweep must remove it, with what
the box wrote there (links to host files, deep trees, fifos), and never follow what the box
planted to anything outside it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Sandbox
from corral.backends import backend_for, base
from corral.backends.host import tempws

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

HOST = """
import asyncio, json, sys
from corral import Policy, Sandbox

async def main():
    sb = Sandbox(Policy(**json.loads(sys.argv[1])))
    await sb.start()
    r = await sb.run(sys.argv[2])
    assert r.exit_code == 0, r.stderr
    await sb.spawn("sleep 300")
    print(json.dumps({"workspace": str(sb.workspace)}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def plant(victim: Path) -> str:
    """What the box leaves in its workspace: links to the victim (a directory, and a file in
    it), a link inside a directory, a deep tree, a fifo, a read-only directory."""
    return (
        f"ln -s {victim} dirlink && ln -s {victim}/keep.txt filelink && "
        f"mkdir -p sub/deeper && ln -s {victim} sub/deeper/link && "
        "mkdir -p $(printf 'd/%.0s' $(seq 60)) && mkfifo fifo && "
        "mkdir ro && touch ro/f && chmod 0500 ro"
    )


def start_and_kill_host(policy_json: str, command: str) -> Path:
    """A host process starts a box without a workspace, runs ``command`` in it, and is
    SIGKILLed: the workspace it made."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, policy_json, command], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the host process did not start its box within 120 s"
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    return Path(json.loads(line)["workspace"])


async def test_a_killed_hosts_temporary_workspace_goes_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("host data")
    policy = backend_policy("bwrap")
    workspace = start_and_kill_host(policy.model_dump_json(), plant(victim))
    assert workspace.name.startswith(tempws.PREFIX)
    assert (workspace / "dirlink").is_symlink(), "the box planted nothing: the test tests nothing"

    monkeypatch.setattr(base, "_last_sweep", {})  # a new host process's first start
    await backend_for(policy).prepare()  # type: ignore[attr-defined]
    assert not os.path.lexists(workspace)
    assert (victim / "keep.txt").read_text() == "host data"  # nothing followed out of it
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]


async def test_a_closed_box_leaves_no_workspace_nor_record() -> None:
    async with Sandbox(backend_policy("bwrap")) as sb:
        assert sb.workspace is not None
        own = sb.workspace
        record = tempws._records() / f"{sb.sandbox_id}.json"
        assert json.loads(record.read_text())["path"] == str(own)
        assert (await sb.run("ln -s / rootlink && mkdir -p a/b && touch a/b/c")).exit_code == 0
    assert not os.path.lexists(own)
    assert not record.exists()


def test_a_record_naming_anything_else_is_not_followed(tmp_path: Path) -> None:
    """A record whose directory is gone and was made again by someone else (another uid), or
    names a link or a directory not named corral-ws-*, removes nothing."""
    other = tmp_path / "corral-ws-other"
    other.mkdir()
    (other / "f").write_text("x")
    os.chown(other, 4321, 4321)
    plain = tmp_path / "not-a-workspace"
    plain.mkdir()
    link = tmp_path / "corral-ws-link"
    link.symlink_to(plain)
    records = tempws._records()
    records.mkdir(mode=0o700, parents=True, exist_ok=True)
    names = []
    for i, path in enumerate((other, plain, link)):
        name = f"test-record-{os.getpid()}-{i}.json"
        names.append(name)
        (records / name).write_text(
            # 2**22 + 1: above any pid_max, an owner that is gone
            json.dumps({"host_pid": 2**22 + 1, "path": str(path), "uid": os.getuid()})
        )
    try:
        tempws.sweep()
        assert (other / "f").read_text() == "x"
        assert plain.is_dir() and link.is_symlink()
        assert not any((records / n).exists() for n in names)  # dead owners' records go
    finally:
        for n in names:
            (records / n).unlink(missing_ok=True)
