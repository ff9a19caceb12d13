"""Network overhead: one HTTP request through corral's egress proxy vs a direct one, same run.

    python bench/bench_network.py [--requests N]

The same client script (python urllib, a new connection per request, timed in-process) runs
  direct     on the host, to a server on the host's 127.0.0.1
  proxied    inside an allowlist box: loopback forwarder -> unix socket -> host proxy
             (allowlist check, resolution, address screening, audit) -> the same server
  ports      inside a ports box: loopback forwarder -> unix socket -> host relay -> server
  vm-proxied the proxied client in a microVM (when that backend works here): the agent's
             loopback listener -> the ``corral-net`` virtio-serial port -> the host's link
             multiplexer -> the same proxy; fewer requests (software emulation is slow)
  vm-ports   the same for the ports relay
  vm-local   the baseline of both: the same client and server, both inside the microVM
and the p50/p90 per request and the ratios to direct are printed. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess

from corral import Policy, Sandbox
from corral.backends import unavailable_reason
from corral.net import StaticResolver

VM_REQUESTS = 50

CLIENT = """
import json, sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
urllib.request.urlopen(url).read()  # warm-up: imports, first connection
out = []
for _ in range(n):
    t = time.perf_counter()
    urllib.request.urlopen(url).read()
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


# The server runs in its own process: sharing the GIL with the proxy's event loop would
# charge thread switches (5 ms switch interval) to the proxy.
SERVER = """
import http.server, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"x" * 512
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def report(name: str, samples: list[float], base: float | None) -> float:
    p50 = statistics.median(samples) * 1000
    p90 = sorted(samples)[int(0.9 * (len(samples) - 1))] * 1000
    ratio = f"   {p50 / base:5.2f}x direct" if base else ""
    print(f"  {name:<10} p50 {p50:7.3f} ms   p90 {p90:7.3f} ms   n={len(samples)}{ratio}")
    return p50


async def in_box(policy: Policy, url: str, n: int, resolver: StaticResolver | None) -> list[float]:
    async with Sandbox(policy, resolver=resolver) as sb:
        r = await sb.run(["python3", "-I", "-c", CLIENT, url, str(n)], timeout=120)
        if r.exit_code != 0:
            raise SystemExit(f"client failed in the box: {r.stderr}")
        samples: list[float] = json.loads(r.stdout)
        return samples


async def in_vm_locally(policy: Policy, n: int) -> list[float]:
    """The client against the same server run inside the VM (what emulation itself costs)."""
    script = (
        'python3 -I -c "$SERVER" > /tmp/port & '
        "while [ ! -s /tmp/port ]; do sleep 0.05; done; "
        'python3 -I -c "$CLIENT" "http://127.0.0.1:$(cat /tmp/port)/" "$N"; kill $!'
    )
    env = {"SERVER": SERVER, "CLIENT": CLIENT, "N": str(n)}
    async with Sandbox(policy) as sb:
        r = await sb.run(script, env=env, timeout=120)
        if r.exit_code != 0:
            raise SystemExit(f"client failed in the VM: {r.stderr}")
        samples: list[float] = json.loads(r.stdout)
        return samples


def measure_direct(port: int, n: int) -> list[float]:
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", CLIENT, f"http://127.0.0.1:{port}/", str(n)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "no_proxy": "*"},
    ).stdout
    samples: list[float] = json.loads(out)
    return samples


async def measure(port: int, n: int, direct: list[float], microvm: bool) -> None:
    allowlist = Policy(
        network={"mode": "allowlist", "allow_hosts": ["bench.test"], "allow_private": ["127.0.0.1"]}
    )
    names = StaticResolver({"bench.test": "127.0.0.1"})
    proxied = await in_box(allowlist, f"http://bench.test:{port}/", n, names)
    ports = Policy(network={"mode": "ports", "ports": [port]})
    relayed = await in_box(ports, f"http://127.0.0.1:{port}/", n, None)
    vm: dict[str, list[float]] = {}
    skip = unavailable_reason(Policy(backend="microvm")) if microvm else "--no-microvm"
    if skip is None:
        on_vm = {"backend": "microvm"}
        vm["vm-proxied"] = await in_box(
            allowlist.model_copy(update=on_vm), f"http://bench.test:{port}/", VM_REQUESTS, names
        )
        vm["vm-ports"] = await in_box(
            ports.model_copy(update=on_vm), f"http://127.0.0.1:{port}/", VM_REQUESTS, None
        )
        vm["vm-local"] = await in_vm_locally(Policy(backend="microvm"), VM_REQUESTS)
    print(f"HTTP GET of 512 bytes, new connection per request ({n} requests each)")
    base = report("direct", direct, None)
    report("proxied", proxied, base)
    report("ports", relayed, base)
    for name, samples in vm.items():
        report(name, samples, base)
    if skip is not None:
        print(f"  microVM rows skipped: {skip}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--no-microvm", action="store_true", help="skip the microVM rows")
    args = parser.parse_args()
    requests = args.requests
    # Started outside the event loop, so asyncio's child watcher never sees it.
    server = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        direct = measure_direct(port, requests)
        asyncio.run(measure(port, requests, direct, not args.no_microvm))
    finally:
        server.kill()
        server.wait()
