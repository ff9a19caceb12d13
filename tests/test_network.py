"""Network policy in real boxes, with servers on 127.0.0.1 only.

Test names (``allowed.test`` ...) are resolved by the proxy's static resolver to 127.0.0.1,
which the policy then has to open with ``allow_private``: no test sends traffic anywhere but
the host's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Policy, Sandbox, SyncSandbox
from corral.audit import read_records
from corral.errors import BackendUnavailable, PolicyError
from corral.net import StaticResolver
from corral.net.nat import missing_tools
from loopback_http import LoopbackHttp

pytestmark = pytest.mark.needs_bwrap

BACKEND = os.environ.get("CORRAL_TEST_BACKENDS", "bwrap").split(",")[0]
NAMES = StaticResolver(
    {"allowed.test": "127.0.0.1", "api.wild.test": "127.0.0.1", "lan.wild.test": "10.9.9.9"}
)


@pytest.fixture
async def host_server() -> AsyncIterator[LoopbackHttp]:
    server = await LoopbackHttp().start()
    yield server
    await server.close()


def net_policy(tmp_path: Path, **network: object) -> Policy:
    return backend_policy(BACKEND, network=network, audit_log=tmp_path / "audit.jsonl")


@pytest.fixture
async def allowlist_box(tmp_path: Path, workspace: Path) -> AsyncIterator[Sandbox]:
    policy = net_policy(
        tmp_path,
        mode="allowlist",
        allow_hosts=["allowed.test", "*.wild.test"],
        allow_private=["127.0.0.1"],
    )
    async with Sandbox(policy, workspace=workspace, resolver=NAMES) as sb:
        yield sb


def pasta_processes() -> set[int]:
    """Live (not zombie) pasta processes on the host."""
    out = subprocess.run(["ps", "-eo", "pid,stat,comm"], capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    return {int(r[0]) for r in rows if "passt" in r[2] and not r[1].startswith("Z")}


# ---- allowlist ----------------------------------------------------------------------------


async def test_curl_reaches_an_allowed_host_every_way(
    allowlist_box: Sandbox, host_server: LoopbackHttp
) -> None:
    url = f"http://allowed.test:{host_server.port}"
    for cmd in (
        f"curl -sS {url}/plain",  # absolute-form GET through HTTP_PROXY
        f"curl -sS -p {url}/tunnel",  # CONNECT
        f"curl -sS --proxy $ALL_PROXY http://api.wild.test:{host_server.port}/socks",  # SOCKS5
    ):
        r = await allowlist_box.run(cmd, timeout=20)
        assert r.exit_code == 0, (cmd, r.stderr)
        assert r.stdout.startswith("hello /"), r.stdout


async def test_python_urllib_reaches_an_allowed_host(
    allowlist_box: Sandbox, host_server: LoopbackHttp
) -> None:
    code = (
        "import urllib.request; "
        f"print(urllib.request.urlopen('http://allowed.test:{host_server.port}/py').read().decode())"
    )
    r = await allowlist_box.run(["python3", "-c", code], timeout=20)
    assert r.stdout.strip() == "hello /py", r.stderr


async def test_node_fetch_reaches_an_allowed_host(
    allowlist_box: Sandbox, host_server: LoopbackHttp
) -> None:
    js = (
        f"fetch('http://allowed.test:{host_server.port}/node')"
        ".then(r => r.text()).then(t => process.stdout.write(t))"
    )
    r = await allowlist_box.run(["node", "-e", js], timeout=20)
    assert r.stdout.strip() == "hello /node", r.stderr


async def test_a_host_not_on_the_list_is_refused_clearly_and_audited(
    allowlist_box: Sandbox, host_server: LoopbackHttp
) -> None:
    r = await allowlist_box.run(f"curl -sS http://denied.test:{host_server.port}/x", timeout=20)
    assert "denied.test" in r.stdout and "network.allow_hosts" in r.stdout
    code = (
        "import urllib.request, urllib.error\n"
        "try:\n"
        "    urllib.request.urlopen('http://wild.test/')\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code, e.read().decode())\n"
    )
    r = await allowlist_box.run(["python3", "-c", code], timeout=20)
    assert r.stdout.startswith("403 corral: connection to wild.test:80 refused"), r.stdout
    js = "fetch('https://denied.test/').catch(e => console.log(String(e.cause)))"
    r = await allowlist_box.run(["node", "-e", js], timeout=20)
    assert "403" in r.stdout and "network.allow_hosts" in r.stdout, r.stdout + r.stderr
    assert host_server.hits == 0
    assert allowlist_box.policy.audit_log is not None
    denials = [
        (rec["host"], rec["protocol"])
        for rec in read_records(allowlist_box.policy.audit_log)
        if rec["kind"] == "network" and rec["action"] == "deny"
    ]
    assert denials == [("denied.test", "http"), ("wild.test", "http"), ("denied.test", "connect")]


async def test_refusals_are_on_the_result_and_in_pips_own_error(allowlist_box: Sandbox) -> None:
    r = await allowlist_box.run(
        "python3 -m pip download --no-cache-dir --no-deps -d /tmp/dl "
        "--index-url https://denied.test/simple nothing",
        timeout=60,
    )
    reason = "corral: denied.test:443 is not in network.allow_hosts; allow it with --allow-host"
    # pip shows the status line of a refused CONNECT: the reason is in it
    assert f"Tunnel connection failed: 403 {reason} denied.test" in r.stderr, r.stderr
    # a refusal is final: pip is told to retry once, not for 12 s with backoff
    assert r.stderr.count("Retrying") <= 1 and r.duration < 10, (r.duration, r.stderr)
    assert r.network_refusals
    assert {(x.host, x.port, x.protocol, x.status) for x in r.network_refusals} == {
        ("denied.test", 443, "connect", 403)
    }
    assert r.network_refusals[0].reason == f"{reason} denied.test"
    # the next command starts with a clean slate
    assert (await allowlist_box.run("true")).network_refusals == ()


async def test_a_name_on_a_private_address_says_which_and_how_to_allow_it(
    allowlist_box: Sandbox,
) -> None:
    r = await allowlist_box.run("curl -sS https://lan.wild.test/", timeout=20)
    assert r.exit_code == 56  # curl: "CONNECT tunnel failed, response 403"
    (refusal,) = r.network_refusals
    assert refusal.reason == (
        "corral: lan.wild.test resolves to 10.9.9.9, a private address; allow it with "
        'network.allow_private = ["10.9.9.9"] or --allow-private 10.9.9.9'
    )
    plain = await allowlist_box.run("curl -sS http://lan.wild.test/", timeout=20)
    assert "network.allow_private" in plain.stdout  # the body of the 403


def test_corral_run_prints_the_refusals_after_the_command(workspace: Path) -> None:
    argv = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(workspace)]
    argv += ["--allow-host", "allowed.test", "--", "curl", "-sS", "https://denied.test/"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 56
    assert r.stderr.splitlines()[-2:] == [
        "curl: (56) CONNECT tunnel failed, response 403",
        "corral: network refused: denied.test:443 is not in network.allow_hosts; allow it with "
        "--allow-host denied.test",
    ]
    r = subprocess.run(
        [*argv[:4], "--json", *argv[4:]], capture_output=True, text=True, check=False
    )
    (refusal,) = json.loads(r.stdout)["network_refusals"]
    assert (refusal["host"], refusal["port"], refusal["status"]) == ("denied.test", 443, 403)


async def test_a_direct_connection_ignoring_the_proxy_fails(
    allowlist_box: Sandbox, host_server: LoopbackHttp
) -> None:
    r = await allowlist_box.run(f"curl -sS --noproxy '*' http://127.0.0.1:{host_server.port}/")
    assert r.exit_code == 7  # connection refused: the box's loopback is its own
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('203.0.113.7', 80), timeout=3)\n"  # TEST-NET-3
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    r = await allowlist_box.run(["python3", "-c", code])
    assert r.stdout.strip() == "101"  # ENETUNREACH: no route out of the box at all
    assert host_server.hits == 0


async def test_dns_to_the_outside_fails(allowlist_box: Sandbox) -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 443)\n"
        "    print('resolved')\n"
        "except socket.gaierror as e:\n"
        "    print('failed')\n"
    )
    r = await allowlist_box.run(["python3", "-c", code], timeout=20)
    assert r.stdout.strip() == "failed"


def test_the_proxy_works_for_sync_sandboxes(tmp_path: Path, workspace: Path) -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    policy = net_policy(
        tmp_path, mode="allowlist", allow_hosts=["allowed.test"], allow_private=["127.0.0.1"]
    )
    try:
        with SyncSandbox(policy, workspace=workspace, resolver=NAMES) as sb:
            assert sb.run(f"curl -sS http://allowed.test:{port}/").stdout == "ok\n"
    finally:
        server.shutdown()
        server.server_close()


async def test_the_proxy_closes_with_the_sandbox(tmp_path: Path, workspace: Path) -> None:
    policy = net_policy(tmp_path, mode="allowlist", allow_hosts=["allowed.test"])
    sb = Sandbox(policy, workspace=workspace, resolver=NAMES)
    await sb.start()
    assert sb._network is not None
    sock = sb._network.guest_dir / "proxy.sock"
    assert sock.exists()
    await sb.aclose()
    assert not sb._network.host_dir.exists()
    with pytest.raises(FileNotFoundError), socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))


@pytest.mark.parametrize(
    ("network", "message"),
    [
        ({"mode": "none", "ports": [8080]}, "network.ports"),
        ({"mode": "allowlist"}, "allow_hosts"),
        ({"mode": "ports"}, "network.ports"),
        ({"mode": "allowlist", "allow_hosts": ["a.*.com"]}, "a.*.com"),
    ],
)
async def test_contradictory_network_policies_are_refused(
    tmp_path: Path, workspace: Path, network: dict[str, object], message: str
) -> None:
    with pytest.raises(PolicyError, match=message.replace(".", r"\.").replace("*", r"\*")):
        async with Sandbox(net_policy(tmp_path, **network), workspace=workspace):
            pass


# ---- ports --------------------------------------------------------------------------------


async def test_ports_mode_exposes_exactly_the_listed_ports(tmp_path: Path, workspace: Path) -> None:
    listed, other = await LoopbackHttp().start(), await LoopbackHttp().start()
    try:
        policy = net_policy(tmp_path, mode="ports", ports=[listed.port])
        async with Sandbox(policy, workspace=workspace) as sb:
            for host in ("127.0.0.1", "localhost"):
                r = await sb.run(f"curl -sS http://{host}:{listed.port}/in", timeout=20)
                assert r.stdout == "hello /in\n", r.stderr
            r = await sb.run(f"curl -sS http://127.0.0.1:{other.port}/")
            assert r.exit_code == 7
            r = await sb.run("env")
            assert "proxy" not in r.stdout.lower()
        assert other.hits == 0
    finally:
        await listed.close()
        await other.close()


# ---- full ---------------------------------------------------------------------------------

full_unavailable = pytest.mark.skipif(
    bool(missing_tools()), reason=f"full mode needs {', '.join(missing_tools())}"
)


@contextlib.asynccontextmanager
async def full_box(policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    """A full-mode box, or a skip where the backend has no full mode yet."""
    sb = Sandbox(policy, workspace=workspace)
    try:
        await sb.start()
    except BackendUnavailable as exc:
        pytest.skip(exc.message)
    try:
        yield sb
    finally:
        await sb.aclose()


async def _gateway(sb: Sandbox) -> str:
    r = await sb.run("cat /proc/net/route")
    for line in r.stdout.splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    raise AssertionError(f"no default route in the box: {r.stdout}")


@full_unavailable
async def test_full_mode_has_an_interface_and_blocks_host_loopback(
    tmp_path: Path, workspace: Path, host_server: LoopbackHttp
) -> None:
    before = pasta_processes()
    async with full_box(net_policy(tmp_path, mode="full"), workspace) as sb:
        links = (await sb.run("cat /proc/net/dev")).stdout.splitlines()[2:]
        assert [ln for ln in links if ln.split(":")[0].strip() != "lo"]
        gateway = await _gateway(sb)
        # The gateway is where user-mode NAT would map the host's loopback: refused by the
        # box's own nftables rules, so not even pasta sees the attempt.
        for target in (gateway, "127.0.0.1"):
            r = await sb.run(f"curl -sS -m 5 http://{target}:{host_server.port}/", timeout=20)
            assert r.exit_code == 7, (target, r.stdout, r.stderr)
        # root of the box cannot lift the fence either
        r = await sb.run("nft flush ruleset 2>&1 || echo refused")
        assert "refused" in r.stdout
    assert host_server.hits == 0
    assert pasta_processes() <= before, "pasta outlived its sandbox"


@full_unavailable
async def test_full_mode_reaches_host_loopback_when_allowed(
    tmp_path: Path, workspace: Path, host_server: LoopbackHttp
) -> None:
    policy = net_policy(tmp_path, mode="full", allow_private=["127.0.0.1"])
    async with full_box(policy, workspace) as sb:
        gateway = await _gateway(sb)
        r = await sb.run(f"curl -sS -m 5 http://{gateway}:{host_server.port}/gw", timeout=20)
        assert r.stdout == "hello /gw\n", r.stderr
        resolv = await sb.run("cat /etc/resolv.conf")
        assert resolv.stdout == "nameserver 169.254.0.53\n"  # pasta's DNS forwarder


def test_no_pasta_left_behind() -> None:
    """Runs last in this module: every full-mode box above cleaned up after itself."""
    leftovers = pasta_processes()
    owned = [
        pid
        for pid in leftovers
        if "/corral/" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    ]
    assert not owned, owned
