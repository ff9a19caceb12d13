"""What a box leaves running when its host process dies hard (issue 13).

Every box runs under two host uids of its own slot (``users``: its namespace owner and its
commands' uid), and the slot's lock is held by the host process that started it. A SIGKILL
of that process frees the slot at once, while what ran as the slot's uids may live on:
pasta (a full-mode network runs as the namespace owner and outlives its parent), a detached
OCI box, whatever a start killed half-way had begun. The next box would then share its
uids (signals, ptrace checks, per-uid quotas) with the leftovers. Each start's orphan sweep
(``ucounts.sweep_free_slots``) kills every process of a slot nobody holds, before the slot
is handed out again.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BACKENDS, backend_policy
from corral import Sandbox
from corral.backends import backend_for, base
from corral.backends.host import ucounts
from corral.backends.users import OWNER_UID_BASE

pytestmark = [pytest.mark.attack("processes"), pytest.mark.needs_bwrap]

HOST = """
import asyncio, json, sys
from corral import Policy, Sandbox

async def main():
    sb = Sandbox(Policy(**json.loads(sys.argv[1])))
    await sb.start()
    await sb.spawn("sleep 300")
    box = sb._box
    print(json.dumps({"owner": box._owner.uid, "state": str(box._spec.state_dir)}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_and_kill_host(settings: dict[str, object]) -> tuple[int, Path]:
    """A host process starts a box (full network: pasta runs as the box's namespace owner)
    with a command in it, and is SIGKILLed: the box's slot (its owner uid) and state dir."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, json.dumps(settings)], stdout=subprocess.PIPE
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
    info = json.loads(line)
    return int(info["owner"]) - OWNER_UID_BASE, Path(info["state"])


def pidfds(pids: set[int]) -> Iterator[int]:
    for pid in pids:
        try:
            yield os.pidfd_open(pid)
        except ProcessLookupError:
            continue


def all_exited(fds: list[int], timeout: float) -> bool:
    """Whether every pidfd reports its process gone within ``timeout`` seconds."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = set(fds)
    while left:
        events = poller.poll(timeout * 1000)
        if not events:
            return False
        for fd, _ in events:
            poller.unregister(fd)
            left.discard(fd)
    return True


async def test_a_killed_hosts_box_leaves_nothing_under_its_uids_for_the_next_box(
    backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend_name in ("oci-runsc", "microvm"):
        pytest.skip(f"{backend_name} boxes take no owner slot (their kernel is not the host's)")
    policy = backend_policy(backend_name, network={"mode": "full"})
    slot, state_dir = start_and_kill_host({**BACKENDS[backend_name], "network": {"mode": "full"}})
    owner_json = state_dir / "owner.json"
    record = owner_json.read_bytes()
    fds: list[int] = []
    try:
        leftovers = ucounts.slot_processes().get(slot, set())
        assert leftovers, "nothing outlived the host process: the attack tested nothing"
        fds = list(pidfds(leftovers))
        # The state sweep ends a dead owner's box from its owner.json; a start killed before
        # it wrote one leaves a directory the sweep leaves alone for a minute. Only the slot
        # tells whose the leftovers are.
        owner_json.unlink()
        monkeypatch.setattr(base, "_last_sweep", {})  # a new host process's first start
        async with Sandbox(policy) as sb:
            assert (await sb.run("true")).exit_code == 0
            # The sweep waits for them before it frees the slot: gone before the start ends.
            assert all_exited(fds, 10), ucounts.slot_processes().get(slot, set()) & leftovers
    finally:
        for fd in fds:
            os.close(fd)
        owner_json.write_bytes(record)  # the usual sweep removes the dead box's state
        monkeypatch.setattr(base, "_last_sweep", {})
        await backend_for(policy).prepare()  # type: ignore[attr-defined]
