"""Published ports (``-p``): a box's server reached from the host, vs the same server on the host.

    python bench/bench_publish.py [--connections N] [--mib N]

The same server script (sends one byte, then N MiB of zeros, to each connection) runs
  host       on the host's 127.0.0.1
  published  in a bwrap box with network mode ``none``, published on a free host port: the
             host listener -> the guest agent's dial-back over the unix socket -> the box's
             127.0.0.1
and the host client measures the throughput of one connection and the time from connect to
the first byte (p50 over N connections). Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

from corral import Policy, Sandbox

SERVER = """
import socket, sys
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print(srv.getsockname()[1], flush=True)
chunk = bytes(1 << 20)
while True:
    conn, _ = srv.accept()
    with conn:
        try:
            conn.sendall(b"+")  # a first byte of its own: connect latency, not a chunk's copy
            for _ in range(int(sys.argv[2])):
                conn.sendall(chunk)
        except OSError:
            pass
"""


def pull(port: int) -> tuple[int, float]:
    start, got = time.perf_counter(), 0
    with socket.create_connection(("127.0.0.1", port)) as conn:
        while data := conn.recv(1 << 20):
            got += len(data)
    return got, time.perf_counter() - start


def first_byte(port: int) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.recv(1)
    return time.perf_counter() - start


def measure(name: str, port: int, connections: int) -> None:
    got, took = pull(port)
    p50 = statistics.median(first_byte(port) for _ in range(connections))
    print(f"{name:10} {got / took / 1e6:7.0f} MB/s   connect to first byte p50 {p50 * 1e3:.2f} ms")


def on_host(connections: int, mib: int) -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", SERVER, "0", str(mib)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None
        measure("host", int(host.stdout.readline()), connections)
    finally:
        host.kill()
        host.wait()


async def main(connections: int, mib: int) -> None:
    on_host(connections, mib)
    policy = Policy(network={"publish": ["0:8000"]})
    async with Sandbox(policy) as sb:
        await sb.files.write("server.py", SERVER)
        proc = await sb.spawn(["python3", "server.py", "8000", str(mib)])
        queue = proc.subscribe()
        async with asyncio.timeout(60):
            while not proc.output().strip():
                await queue.get()
        port = sb.published[0].port_on_host
        # the client in a process of its own, as a user's would be (not sharing the GIL of
        # the process that runs the sandbox and its relays)
        client = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", str(port), "--connections", str(connections)
        )
        await client.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        measure("published", args.client, args.connections)
    else:
        asyncio.run(main(args.connections, args.mib))
