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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import BACKENDS, backend_policy, rootless_skip
from corral import Sandbox
from corral.backends import backend_for, base
from corral.backends.host import ucounts
from corral.backends.users import OWNER_UID_BASE, own_block

pytestmark = [
    pytest.mark.attack("processes"),
    pytest.mark.needs_bwrap,
    rootless_skip(
        "no slots: rootless boxes run as the user's own ids, which no later box is handed; "
        "what a killed host's box leaves (state, pasta) goes at the next start's sweep "
        "(test_sigkill_the_host_process_mid_command, tests/rootless/test_rootless_oci.py)"
    ),
]

HOST = """
import asyncio, json, sys
from corral import Policy, Sandbox

async def main():
    sb = Sandbox(Policy(**json.loads(sys.argv[1])))
    await sb.start()
    await sb.spawn(sys.argv[2] if len(sys.argv) > 2 else "sleep 300")
    box = sb._box
    print(json.dumps({"owner": box._owner.uid, "state": str(box._spec.state_dir)}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def start_and_kill_host(
    settings: dict[str, object],
    command: str = "sleep 300",
    before_kill: Callable[[int], object] = lambda slot: None,
) -> tuple[int, Path]:
    """A host process starts a box (full network: pasta runs as the box's namespace owner)
    with a command in it, and is SIGKILLed: the box's slot (its owner uid) and state dir.
    ``before_kill(slot)`` runs while the host still lives."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, json.dumps(settings), command], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the host process did not start its box within 120 s"
        line = proc.stdout.readline()
        before_kill(int(json.loads(line)["owner"]) - OWNER_UID_BASE)
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


OTHER_UID = 1234
DETACHED = (
    "python3 -c 'import os, time\n"
    "if os.fork() == 0:\n"
    f"    os.setsid(); os.setgid({OTHER_UID}); os.setuid({OTHER_UID})\n"
    "    if os.fork() == 0: time.sleep(300)\n"
    "    os._exit(0)\n"
    "time.sleep(300)'"
)


async def test_a_process_under_another_box_uid_does_not_outlive_a_killed_host(
    backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box whose commands are box root may take any box uid: a detached
    process as box uid 1234 (its own session, double-forked) must be gone once the host
    process that started the box is SIGKILLed (the box's PID namespace ends with its init;
    the next start's sweep kills what still runs under the slot's block of ids)."""
    if backend_name in ("oci-runsc", "microvm"):
        pytest.skip(f"{backend_name} runs no box as root here")
    policy = backend_policy(backend_name)
    seen: dict[str, set[int]] = {}

    def find(slot: int) -> None:
        uid = own_block(OWNER_UID_BASE + slot) + OTHER_UID
        for _ in range(100):  # the command is spawned; its grandchild comes a moment later
            seen["pids"] = {
                p for p, found in ucounts._slot_scan().get(slot, {}).items() if uid in found
            }
            if seen["pids"]:
                return
            select.select([], [], [], 0.05)

    start_and_kill_host({**BACKENDS[backend_name], "user": "root"}, DETACHED, find)
    assert seen.get("pids"), "no process ran as box uid 1234: the attack tested nothing"
    fds = list(pidfds(seen["pids"]))
    try:
        monkeypatch.setattr(base, "_last_sweep", {})
        async with Sandbox(policy) as sb:
            assert (await sb.run("true")).exit_code == 0
            assert all_exited(fds, 10), seen["pids"]
    finally:
        for fd in fds:
            os.close(fd)
        monkeypatch.setattr(base, "_last_sweep", {})
        await backend_for(policy).prepare()  # type: ignore[attr-defined]
