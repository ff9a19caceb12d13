"""What a box need not see (issue 13, class 9): bwrap's command line (host paths, the mask
list) in ``/proc/1/cmdline``, and the host's cgroupfs listing other boxes. The kernel pools
every box shares (class 6) are ``test_attack_quotas.py``'s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from security.helpers import box_py

pytestmark = [pytest.mark.attack("processes"), pytest.mark.needs_bwrap]


@pytest.fixture
async def other_box(box_policy: Policy, tmp_path: Path) -> AsyncIterator[Sandbox]:
    ws = tmp_path / "other"
    ws.mkdir()
    async with Sandbox(box_policy, workspace=ws) as sb:
        yield sb


async def test_command_lines_hide_host_paths_and_masks(sandbox: Sandbox, workspace: Path) -> None:
    res_code = (
        "res = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try:\n"
        "            res[p] = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
        "        except OSError:\n"
        "            pass\n"
    )
    lines = await box_py(sandbox, res_code)
    assert lines, "no process visible at all"
    joined = "\n".join(lines.values())
    assert str(workspace) not in joined
    for option in ("--ro-bind", "--bind", "--tmpfs", "--seccomp", "/etc/shadow"):
        assert option not in joined, (option, lines)


async def test_cgroupfs_shows_no_other_box(sandbox: Sandbox, other_box: Sandbox) -> None:
    code = (
        "res = []\n"
        "for root, dirs, files in os.walk('/sys/fs/cgroup'):\n"
        "    res += [os.path.join(root, d) for d in dirs]\n"
    )
    seen = await box_py(sandbox, code, timeout=60)
    leaks = [p for p in seen if other_box.sandbox_id in p or "/corral" in p]
    assert not leaks, leaks[:5]
