"""MicroVM benchmark: boot-to-agent-ready against a raw boot of the same kernel and initramfs.

    python bench/bench_microvm.py [--runs N] [--execs N]

In one run, interleaved so both see the same host load:
  raw boot        qemu spawn -> the raw-boot marker printed by corral's /init (same kernel,
                  same base initramfs, same accelerator, machine, cpus and memory; the init
                  prints the marker before loading modules or mounting anything)
  boot-to-ready   ``Sandbox.start()`` on the microvm backend, restored from the VM saved at
                  the snapshot point (after the kernel's boot and its modules): qemu spawn,
                  restore, 9p mounts, overlay root, the agent's first frame   target <= 1.2x
  cold boot       the same with ``vm.snapshot = false``: the kernel boots every time
  warm exec       ``run(["true"])`` in a booted VM
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from corral import Policy, Sandbox
from corral.backends.microvm import box as microvm
from corral.backends.microvm import initramfs
from corral.policy import vm_memory_mb


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def main(runs: int, execs: int) -> int:
    policy = Policy(backend="microvm")
    backend = microvm.MicroVmBackend.for_policy(policy)
    boot = await backend.boot_mode()
    print(f"accel={boot.accel} machine={boot.machine} kernel={backend.kernel.image}")
    cold_policy = policy.model_copy(update={"vm": policy.vm.model_copy(update={"snapshot": False})})
    raw: list[float] = []
    ready: list[float] = []
    cold: list[float] = []
    warm: list[float] = []
    workspace = Path(tempfile.mkdtemp(prefix="corral-bench-vm-"))
    try:
        async with Sandbox(policy, workspace=workspace, backend=backend) as sb:
            print(f"first VM of this shape: {(await sb.info())['boot']}")  # saves the snapshot
        for i in range(runs):
            elapsed = await microvm.raw_boot(
                backend.qemu, boot, backend.base, 120,
                cpus=policy.vm.cpus, memory_mb=vm_memory_mb(policy),
            )  # fmt: skip
            if elapsed is None:
                print(f"raw boot never printed {initramfs.RAW_MARKER!r}", file=sys.stderr)
                return 1
            raw.append(elapsed)
            started = time.monotonic()
            async with Sandbox(cold_policy, workspace=workspace, backend=backend) as sb:
                cold.append(time.monotonic() - started)
            started = time.monotonic()
            async with Sandbox(policy, workspace=workspace, backend=backend) as sb:
                ready.append(time.monotonic() - started)
                assert (await sb.info())["boot"] == "restored"
                if i == runs - 1:
                    for _ in range(execs):
                        t = time.monotonic()
                        await sb.run(["true"], timeout=30)
                        warm.append(time.monotonic() - t)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    r, b, c, w = p50_ms(raw), p50_ms(ready), p50_ms(cold), p50_ms(warm)
    print(f"raw boot to marker     p50 {r:8.0f} ms  ({runs} runs)")
    print(f"boot to agent ready    p50 {b:8.0f} ms  ratio {b / r:.2f}x raw  (target <= 1.2x)")
    print(f"  without a snapshot   p50 {c:8.0f} ms  ratio {c / r:.2f}x raw  (vm.snapshot = false)")
    print(f"warm exec `true`       p50 {w:8.1f} ms  ({execs} runs)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--execs", type=int, default=20)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.runs, args.execs)))
