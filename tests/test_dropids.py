"""Host commands run as another uid without forking the caller (backends/host/dropids.py).

subprocess's ``user=``/``group=`` fork the whole calling process while holding the GIL: in a
large process (a server holding boxes, a long test session) that froze every thread, the
event loop's included, for tens of milliseconds per spawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Policy, Sandbox
from corral.backends.host import dropids

NOBODY = 65534


def test_the_prefix_runs_the_command_as_the_uid_with_no_groups() -> None:
    prefix = dropids.as_uid(NOBODY)
    assert prefix is not None, "util-linux's unshare or setpriv is on every supported host"
    out = subprocess.run(
        [*prefix, "sh", "-c", "id -u; id -g; id -G"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(NOBODY)] * 3


def test_whether_unshare_sets_ids_is_asked_once_per_program(tmp_path: Path) -> None:
    """`unshare --help` is run by the first process only; later ones read its answer, and
    an answer kept for another file (an upgraded unshare) is asked again."""
    env = {**os.environ, "CORRAL_STATE_DIR": str(tmp_path)}
    show = (
        "from corral.backends.host import dropids; "
        "dropids._sets_ids = lambda path: print('asked') or False; print(dropids.id_dropper())"
    )

    def dropper() -> list[str]:
        r = subprocess.run(
            [sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    first = dropper()
    assert first[0] == "asked" and "setpriv" in first[1]  # as answered: no --setuid
    record = tmp_path / "unshare-sets-ids.json"
    assert json.loads(record.read_text())["value"] is False
    assert dropper() == first[1:]  # read, not asked
    saved = json.loads(record.read_text())
    saved["key"]["mtime"] += 1
    record.write_text(json.dumps(saved))
    assert dropper() == first  # another file's answer: asked again


@pytest.mark.parametrize("groups", [(), (NOBODY - 1, NOBODY - 2)])
def test_the_prefix_runs_the_command_as_the_ids_with_exactly_the_groups(
    groups: tuple[int, ...],
) -> None:
    """qemu's jail as root: the share owner's uid and gid, plus /dev/kvm's group with KVM."""
    prefix = dropids.as_ids(NOBODY, NOBODY - 3, groups)
    assert prefix is not None
    out = subprocess.run(
        [*prefix, "sh", "-c", "id -u; id -g; id -G"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[:2] == [str(NOBODY), str(NOBODY - 3)]
    assert sorted(map(int, out[2:])) == sorted({NOBODY - 3, *groups})


@pytest.fixture
def large_process() -> Iterator[bytes]:
    """This process made large (768 MiB of touched memory, 4 KiB pages): forking it copies
    ~200k page-table entries, ~50 ms here; a vfork does not."""
    ballast = b"x" * (768 << 20)
    yield ballast
    del ballast


@pytest.fixture
def full_policy(backend_name: str) -> Policy:
    """Built off the loop: the first box of a backend imports it. A microVM has no full
    network (no NIC): its box is the plain one, whose jailed qemu starts as another uid."""
    if backend_name == "microvm":
        return backend_policy(backend_name)
    return backend_policy(backend_name, network={"mode": "full"})


async def test_a_full_network_box_starts_without_forking_a_large_process(
    large_process: bytes, full_policy: Policy, loop_watch: None, workspace: Path
) -> None:
    # The loop watch fails the test if any step held the loop over 20 ms: the OCI box's
    # network namespace holder, started as the box's owner uid, forked this process on the
    # loop (the flaky full-mode attack test of the whole suite).
    async with Sandbox(full_policy, workspace=workspace) as sb:
        assert (await sb.run("echo up")).stdout == "up\n"
    assert len(large_process) == 768 << 20
