"""Each box's user namespace gets an owner uid of its own (the kernel charges inotify and
message queue quotas to it): the slots, and the id maps that make box root that owner."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.backends.host import ucounts
from corral.backends.users import (
    BOX_UID,
    COMMAND_HOST_ID,
    HOST_UID_BASE,
    ID_RANGE,
    OWNER_SLOTS,
    OWNER_UID_BASE,
    id_map,
    id_ranges,
)
from corral.errors import BackendError


@pytest.fixture(autouse=True)
def own_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))


def test_running_boxes_never_share_an_owner() -> None:
    held = [ucounts.claim_owner("cb-same") for _ in range(5)]
    uids = {o.uid for o in held}
    assert len(uids) == 5
    assert all(OWNER_UID_BASE <= u < OWNER_UID_BASE + OWNER_SLOTS for u in uids)
    first = held[0].uid
    held[0].release()
    held[0].release()  # idempotent
    again = ucounts.claim_owner("cb-same")
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
