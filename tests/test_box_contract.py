"""What every backend's box has, beyond its limits (those are ``test_limits_contract.py``):
the same /dev a program expects of a Linux machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import Policy, Sandbox

pytestmark = [pytest.mark.slow]

SHARED_MEMORY = """
import multiprocessing, os
from multiprocessing import shared_memory
lock = multiprocessing.Lock()  # a POSIX semaphore: a file in /dev/shm
with lock:
    block = shared_memory.SharedMemory(create=True, size=4096)
    block.buf[:2] = b"ok"
    print(bytes(block.buf[:2]).decode(), oct(os.stat("/dev/shm").st_mode & 0o7777))
    block.close()
    block.unlink()
"""


async def test_the_same_dev_on_every_backend(box_policy: Policy, workspace: Path) -> None:
    async with Sandbox(box_policy, workspace=workspace) as sb:
        r = await sb.run(["python3", "-c", SHARED_MEMORY])
        assert (r.exit_code, r.stdout) == (0, "ok 0o1777\n"), r.stderr
        r = await sb.run("test -d /dev/mqueue && grep -c ' /dev/shm tmpfs ' /proc/mounts")
        assert (r.exit_code, r.stdout) == (0, "1\n"), r.stderr


async def test_every_writable_tmpfs_is_capped_at_tmp_size(
    box_policy: Policy, workspace: Path
) -> None:
    """/tmp, /dev/shm, /run and the home are each a tmpfs of ``filesystem.tmp_size`` on every
    backend: a tmpfs is memory, and bwrap's uncapped home (half the host's RAM) filled past
    the box's memory limit took the guest agent, and the box, with it."""
    fs = box_policy.filesystem.model_copy(update={"tmp_size": 48 << 20})
    async with Sandbox(box_policy.model_copy(update={"filesystem": fs}), workspace=workspace) as sb:
        r = await sb.run('stat -f -c "%n %b %S" /tmp /dev/shm /run "$HOME"')
        assert r.exit_code == 0, r.stderr
        sizes = {
            line.split()[0]: int(line.split()[1]) * int(line.split()[2])
            for line in r.stdout.splitlines()
        }
        assert set(sizes.values()) == {48 << 20}, sizes
        # Filled: the writer gets ENOSPC, the box goes on.
        r = await sb.run('head -c 64M /dev/zero > "$HOME/big"; echo $?; rm "$HOME/big"')
        assert r.stdout.strip() == "1" and "No space left" in r.stderr, (r.stdout, r.stderr)
        assert (await sb.run("echo alive")).stdout == "alive\n"
