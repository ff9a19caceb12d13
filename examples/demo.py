"""`make demo`: the main job end to end, in a real sandbox.

1. compile a small C program that has a type error, read the diagnostic, fix it, rebuild
2. run a slow "test suite" in the background and poll it while it runs
3. show that the box holds: a write outside the workspace and a network connection fail
"""

from __future__ import annotations

import asyncio
import tempfile

from corral import Policy, Sandbox

BROKEN = """#include <stdio.h>
int main(void) {
    int answer = "forty-two";
    printf("answer=%d\\n", answer);
    return 0;
}
"""

SUITE = """for i in 1 2 3 4 5; do echo "test_$i ... ok"; sleep 0.3; done; echo "5 passed" """


def step(title: str) -> None:
    print(f"\n=== {title}")


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="corral-demo-") as ws:
        policy = Policy.from_dict({"limits": {"memory_bytes": "512M", "max_pids": 128}})
        async with Sandbox(policy, workspace=ws) as sb:
            info = await sb.info()
            print(
                f"box {info['sandbox_id']}: {info['kernel']}, {info['cpus']} cpus, "
                f"backend {info['backend']}, workspace {ws} -> {info['workdir']}"
            )

            step("1. compile: the agent writes code with a bug")
            await sb.files.write("main.c", BROKEN)
            r = await sb.run(["gcc", "-Werror", "-o", "main", "main.c"], timeout=60)
            print(f"gcc exit {r.exit_code}; first diagnostic line:")
            print("   ", next(ln for ln in r.stderr.splitlines() if "error" in ln))
            fixed = BROKEN.replace('"forty-two"', "42")
            await sb.files.write("main.c", fixed)
            r = await sb.run(["gcc", "-Werror", "-o", "main", "main.c"], timeout=60, check=True)
            r = await sb.run(["./main"])
            print(f"after the fix: exit {r.exit_code}, output {r.stdout.strip()!r}")

            step("2. background job: start, poll, read partial output, wait")
            p = await sb.spawn(["sh", "-c", SUITE])
            print(f"started pid {p.pid}, status {p.status}")
            polled = await p.wait(timeout=0.5)
            print(f"poll after 0.5 s: {polled.status} ({polled.message})")
            print("partial output:", p.output().splitlines())
            done = await p.wait(timeout=30)
            last = p.output().splitlines()[-1]
            print(f"finished: {done.status}, exit {done.exit_code}, last line {last!r}")

            step("3. the box holds")
            r = await sb.run("echo pwned > /etc/corral-demo")
            print(f"write to /etc: exit {r.exit_code}: {r.stderr.strip()}")
            r = await sb.run(
                [
                    "python3",
                    "-c",
                    "import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)",
                ]
            )
            print(f"network connection: exit {r.exit_code}: {r.stderr.strip().splitlines()[-1]}")
            r = await sb.run("cat /etc/shadow")
            print(f"read /etc/shadow: exit {r.exit_code}: {r.stderr.strip()}")
            r = await sb.run("ls /proc | grep -cE '^[0-9]+$'")
            print(f"processes visible in the box: {r.stdout.strip()} (the host's are not)")
        print("\nsandbox closed: no process, cgroup, mount or temporary directory left.")


if __name__ == "__main__":
    asyncio.run(main())
