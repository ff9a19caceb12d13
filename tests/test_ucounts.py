"""Each box's user namespace gets an owner uid of its own (the kernel charges inotify and
message queue quotas to it), and its commands a host uid of their own from the same slot
(epoll watches, pipe buffers and processes are charged to that): the slots, and the id maps
that make box root that owner and the box user that uid."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from corral.backends.host import ucounts
from corral.backends.users import (
    BOX_UID,
    COMMAND_HOST_ID,
    COMMAND_UID_BASE,
    HOST_UID_BASE,
    ID_RANGE,
    OWNER_SLOTS,
    OWNER_UID_BASE,
    command_id,
    id_map,
    id_ranges,
)
from corral.errors import BackendError


@pytest.fixture
def slots(tmp_path: Path) -> Path:
    """A lock folder of its own: the host's (``ucounts.OWNERS_DIR``) has running boxes."""
    return tmp_path


def test_running_boxes_never_share_an_owner(slots: Path) -> None:
    held = [ucounts.claim_owner(slots) for _ in range(5)]
    uids = {o.uid for o in held}
    assert len(uids) == 5
    assert all(OWNER_UID_BASE <= u < OWNER_UID_BASE + OWNER_SLOTS for u in uids)
    first = held[0].uid
    held[0].release()
    held[0].release()  # idempotent
    again = ucounts.claim_owner(slots)
    assert again.uid == first  # a closed box's owner is free again
    for o in [again, *held[1:]]:
        o.release()


def test_box_root_maps_to_the_namespace_owner() -> None:
    root = OWNER_UID_BASE + 7
    ranges = id_ranges(COMMAND_HOST_ID, root)
    assert ranges[0] == (0, root, 1)
    assert sum(count for _, _, count in ranges) == ID_RANGE
    assert (BOX_UID, COMMAND_HOST_ID, 1) in ranges
    assert id_map(COMMAND_HOST_ID).startswith(f"0 {HOST_UID_BASE} {BOX_UID}\n")


def test_a_workspace_owner_in_the_owner_range_is_refused() -> None:
    with pytest.raises(BackendError, match="collides"):
        id_ranges(OWNER_UID_BASE + 1)


def test_slots_are_lowest_first_and_give_each_box_its_own_command_id(slots: Path) -> None:
    held = [ucounts.claim_owner(slots) for _ in range(3)]
    assert [o.uid for o in held] == [OWNER_UID_BASE + n for n in range(3)]
    ids = [o.command_id for o in held]
    assert ids == [COMMAND_UID_BASE + n for n in range(3)]
    assert not {o.uid for o in held} & set(ids) and COMMAND_HOST_ID not in ids
    for o in held:
        o.release()


def test_box_user_maps_to_the_command_id_of_its_slot() -> None:
    root = OWNER_UID_BASE + 3
    user = command_id(root)
    ranges = id_ranges(user, root)
    assert (BOX_UID, user, 1) in ranges and ranges[0] == (0, root, 1)
    hosts = [h for _, h, c in ranges for h in range(h, h + c)]
    assert len(hosts) == len(set(hosts)) == ID_RANGE  # no host id twice
    with pytest.raises(BackendError, match="collides"):
        id_ranges(COMMAND_UID_BASE - 1)  # the last namespace owner: never a box user
    with pytest.raises(ValueError, match="not a namespace owner"):
        command_id(COMMAND_HOST_ID)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another uid")
def test_the_sweep_kills_a_free_slots_processes_and_spares_a_held_ones() -> None:
    slot = OWNER_SLOTS - 1  # the last: no box of this host is there while the test runs
    uid = COMMAND_UID_BASE + slot
    held = ucounts._try_slot(ucounts.OWNERS_DIR, slot)
    assert held >= 0, "the last slot is in use"
    proc = subprocess.Popen(["sleep", "300"], user=uid, group=uid, extra_groups=[])
    try:
        assert proc.pid in ucounts.slot_processes()[slot]
        ucounts.sweep_free_slots()
        assert proc.poll() is None  # its slot is held: a running box's
        os.close(held)
        held = -1
        assert slot in ucounts.sweep_free_slots()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert slot not in ucounts.slot_processes()
    finally:
        if held >= 0:
            os.close(held)
        proc.kill()
        proc.wait()


def test_a_root_boxs_other_ids_are_a_block_of_its_own_slot() -> None:
    from corral.backends.users import ROOT_BOX_ID_BASE, own_block

    blocks = [own_block(OWNER_UID_BASE + slot) for slot in range(OWNER_SLOTS)]
    assert len(set(blocks)) == OWNER_SLOTS and min(blocks) == ROOT_BOX_ID_BASE
    last = blocks[-1] + ID_RANGE
    assert last < 3_000_000_000  # below the idmapped mounts' FOREIGN_BASE
    owner = OWNER_UID_BASE + 3
    ranges = id_ranges(command_id(owner), owner, own_block(owner))
    assert ranges[0] == (0, owner, 1) and ranges[1] == (1, own_block(owner) + 1, BOX_UID - 1)
    assert ranges[-1] == (BOX_UID + 1, own_block(owner) + BOX_UID + 1, ID_RANGE - BOX_UID - 1)
    assert sum(count for _, _, count in ranges) == ID_RANGE
    with pytest.raises(BackendError, match="collides"):
        id_ranges(ROOT_BOX_ID_BASE + 5)  # a workspace owner inside the blocks
    with pytest.raises(ValueError, match="not a namespace owner"):
        own_block(HOST_UID_BASE)
