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
