"""The egress proxy and its rules, without boxes: allowlist matching, address screening, the
HTTP and SOCKS5 protocols, refusals and their audit records. Servers on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.audit import AuditLog, read_records
from corral.errors import PolicyError
from corral.net import EgressProxy, StaticResolver, command_env
from corral.net.http import body_framing
from corral.net.nat import nft_ruleset
from corral.net.rules import AddressScreen, HostAllowlist, HostRule, classify, split_host_port
from corral.net.tunnel import client_hello_sni
from corral.policy import NetworkPolicy
from loopback_http import LoopbackHttp

# ---- rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "host", "port", "allowed"),
    [
        ("example.com", "example.com", 443, True),
        ("example.com", "www.example.com", 443, False),
        ("example.com", "badexample.com", 443, False),
        ("*.example.com", "www.example.com", 443, True),
        ("*.example.com", "a.b.example.com", 80, True),
        ("*.example.com", "example.com", 443, False),
        ("*.example.com", "badexample.com", 443, False),
        ("*.example.com", "example.com.evil.test", 443, False),
        ("example.com:443", "example.com", 443, True),
        ("example.com:443", "example.com", 80, False),
        ("*.example.com:8080", "api.example.com", 8080, True),
        ("*.example.com:8080", "api.example.com", 80, False),
        ("EXAMPLE.com.", "example.com", 1, True),
        ("*", "anything.test", 22, True),
        ("*:443", "anything.test", 80, False),
        ("10.0.0.5", "10.0.0.5", 80, True),
        ("[::1]:80", "::1", 80, True),
        ("bücher.example", "xn--bcher-kva.example", 443, True),
    ],
)
def test_allowlist_matching(entry: str, host: str, port: int, allowed: bool) -> None:
    assert HostAllowlist([entry]).allows(host, port) is allowed


@pytest.mark.parametrize(
    "entry", ["", "a.*.com", "*example.com", "ex ample.com", "host:0", "host:99999", "-bad.com"]
)
def test_bad_allowlist_entries_name_the_field(entry: str) -> None:
    with pytest.raises(PolicyError, match=r"network\.allow_hosts"):
        HostRule.parse(entry)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "shared (CGNAT)"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:0a00:0001::1", "private"),
        ("fc00::1", "private"),
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
    ],
)
def test_address_classification(address: str, kind: str | None) -> None:
    assert classify(ipaddress.ip_address(address)) == kind


def test_allow_private_opens_exactly_what_it_names() -> None:
    screen = AddressScreen(["127.0.0.1", "10.0.0.0/24"])
    assert screen.refusal(ipaddress.ip_address("127.0.0.1")) is None
    assert screen.refusal(ipaddress.ip_address("::ffff:127.0.0.1")) is None
    assert screen.refusal(ipaddress.ip_address("10.0.0.77")) is None
    assert screen.refusal(ipaddress.ip_address("127.0.0.2")) == "loopback"
    assert screen.refusal(ipaddress.ip_address("10.0.1.1")) == "private"
    with pytest.raises(PolicyError, match="allow_private"):
        AddressScreen(["not-an-address"])


def test_split_host_port() -> None:
    assert split_host_port("example.com:443") == ("example.com", 443)
    assert split_host_port("[::1]:8080") == ("::1", 8080)
    assert split_host_port("example.com", 80) == ("example.com", 80)
    for bad in ("example.com:http", "[::1", "[::1]x", "h:70000"):
        with pytest.raises(ValueError, match=r"."):
            split_host_port(bad, 80)


def test_command_env_points_every_tool_at_the_proxy() -> None:
    env = command_env(NetworkPolicy(mode="allowlist", allow_hosts=("a.test",)))
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == "socks5h://127.0.0.1:3128"
    assert env["GIT_CONFIG_KEY_0"] == "http.proxy"
    assert "node_proxy.js" in env["NODE_OPTIONS"]
    assert env["PIP_PROXY"] == env["npm_config_https_proxy"]
    moved = command_env(NetworkPolicy(mode="allowlist", allow_hosts=("a",), ports=(3128,)))
    assert moved["HTTP_PROXY"] == "http://127.0.0.1:3129"
    assert command_env(NetworkPolicy(mode="full")) == {}


def test_nft_rules_block_private_ranges_and_open_only_what_is_allowed() -> None:
    closed = nft_ruleset(AddressScreen([]), ["192.0.2.1"])
    assert "10.0.0.0/8" in closed and "127.0.0.0/8" in closed and "fc00::/7" in closed
    assert "192.0.2.1 accept" not in closed
    opened = nft_ruleset(AddressScreen(["127.0.0.1", "10.1.0.0/16"]), ["192.0.2.1"])
    assert "ip daddr 192.0.2.1 accept" in opened
    assert "ip daddr { 127.0.0.1/32, 10.1.0.0/16 } accept" in opened
    # accepts come before the rejects they carve exceptions from
    assert opened.index("192.0.2.1 accept") < opened.index("reject")


# ---- the proxy over a unix socket ----------------------------------------------------------


def _request_line(head: bytes) -> bytes:
    return head.split(b"\r\n")[0] + b"\n"


@pytest.fixture
async def upstream() -> AsyncIterator[LoopbackHttp]:
    up = await LoopbackHttp(_request_line).start()
    yield up
    await up.close()


@pytest.fixture
def audit_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.jsonl"


@pytest.fixture
async def proxy_socket(tmp_path: Path, audit_path: Path) -> AsyncIterator[Path]:
    proxy = EgressProxy(
        HostAllowlist(["allowed.test", "*.wild.test", "private.test", "[::ffff:127.0.0.1]"]),
        AddressScreen(["127.0.0.1"]),
        StaticResolver(
            {
                "allowed.test": "127.0.0.1",
                "a.wild.test": "127.0.0.1",
                "private.test": "10.9.9.9",  # refused before any connection is tried
            }
        ),
        AuditLog(audit_path, "cb-test"),
        connect_timeout=5,
    )
    path = tmp_path / "proxy.sock"
    await proxy.serve(path)
    yield path
    await proxy.close()


async def exchange(path: Path, data: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    writer.write_eof()
    async with asyncio.timeout(10):
        reply = await reader.read()
    writer.close()
    return reply


async def test_absolute_form_get_is_forwarded_in_origin_form(
    proxy_socket: Path, upstream: LoopbackHttp
) -> None:
    request = (
        f"GET http://allowed.test:{upstream.port}/p?q=1 HTTP/1.1\r\n"
        f"Host: allowed.test:{upstream.port}\r\nProxy-Connection: keep-alive\r\n\r\n"
    )
    reply = await exchange(proxy_socket, request.encode())
    assert reply.startswith(b"HTTP/1.1 200 OK")
    assert reply.endswith(b"GET /p?q=1 HTTP/1.1\n")
    head = upstream.heads[0].lower()
    assert b"proxy-connection" not in head and b"connection: close" in head


async def test_connect_tunnels_to_a_wildcard_host(
    proxy_socket: Path, upstream: LoopbackHttp
) -> None:
    reader, writer = await asyncio.open_unix_connection(str(proxy_socket))
    writer.write(f"CONNECT a.wild.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
    async with asyncio.timeout(10):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /tunnel HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.read()).endswith(b"GET /tunnel HTTP/1.1\n")
    writer.close()


async def test_host_not_on_the_list_gets_403_naming_the_field_and_is_audited(
    proxy_socket: Path, audit_path: Path
) -> None:
    for request, name in (
        (b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n", b"evil.test:443"),
        (b"GET http://wild.test/ HTTP/1.1\r\n\r\n", b"wild.test:80"),  # not *.wild.test
    ):
        reply = await exchange(proxy_socket, request)
        # the reason phrase says it all: clients that never show a body show the status line
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line == (
            b"HTTP/1.1 403 corral: " + name + b" is not in network.allow_hosts; allow it with "
            b"--allow-host " + name.split(b":")[0]
        )
        assert b"\r\nX-Corral-Refusal: corral: " + name in reply
        assert b"network.allow_hosts in the policy" in rest
    denied = [r for r in read_records(audit_path) if r["kind"] == "network"]
    assert [(r["action"], r["host"]) for r in denied] == [
        ("deny", "evil.test"),
        ("deny", "wild.test"),
    ]


async def test_private_addresses_are_refused_after_resolution(
    proxy_socket: Path, audit_path: Path
) -> None:
    reply = await exchange(proxy_socket, b"CONNECT private.test:80 HTTP/1.1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403")
    assert b"10.9.9.9" in reply and b"network.allow_private" in reply
    # an IPv4-mapped IPv6 literal of an address outside allow_private is no way around it
    reply = await exchange(proxy_socket, b"CONNECT [::ffff:10.9.9.9]:80 HTTP/1.1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403")
    assert read_records(audit_path)[0]["action"] == "deny"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", b"400"),  # origin-form
        (b"GET https://allowed.test/ HTTP/1.1\r\n\r\n", b"400"),
        (b"HELLO\r\n\r\n", b"400"),
        (b"CONNECT allowed.test HTTP/1.1\r\n\r\n", b"400"),  # no port
        (b"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n", b"400"),
        (b"GET http://allowed.test/ HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET http://a b/ HTTP/1.1\r\n\r\n", b"400"),
        (b"GET http://" + b"a" * 70000 + b"/ HTTP/1.1\r\n\r\n", b"431"),
    ],
)
async def test_malformed_requests_get_errors(
    proxy_socket: Path, request_bytes: bytes, status: bytes
) -> None:
    reply = await exchange(proxy_socket, request_bytes)
    assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]


async def test_unreachable_upstream_is_a_502(proxy_socket: Path, upstream: LoopbackHttp) -> None:
    port = upstream.port
    await upstream.close()  # nothing listens there any more
    reply = await exchange(proxy_socket, f"CONNECT allowed.test:{port} HTTP/1.1\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 502") and b"cannot connect" in reply
    upstream.server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)


def socks_connect(kind: int, address: bytes, port: int, command: int = 1) -> bytes:
    return b"\x05\x01\x00" + bytes([5, command, 0, kind]) + address + struct.pack("!H", port)


async def test_socks5_connect_by_name(proxy_socket: Path, upstream: LoopbackHttp) -> None:
    reader, writer = await asyncio.open_unix_connection(str(proxy_socket))
    name = b"allowed.test"
    writer.write(socks_connect(3, bytes([len(name)]) + name, upstream.port))
    async with asyncio.timeout(10):
        assert await reader.readexactly(2) == b"\x05\x00"
        assert (await reader.readexactly(10))[:2] == b"\x05\x00"
        writer.write(b"GET /socks HTTP/1.1\r\n\r\n")
        assert (await reader.read()).endswith(b"GET /socks HTTP/1.1\n")
    writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [
        # denied host: 0x02 "connection not allowed by ruleset"
        (socks_connect(3, b"\x09evil.test", 80), b"\x05\x00\x05\x02"),
        # a private IP literal not in allow_private
        (socks_connect(1, bytes([10, 9, 9, 9]), 80), b"\x05\x00\x05\x02"),
        # BIND and UDP ASSOCIATE are not supported: 0x07
        (socks_connect(3, b"\x0callowed.test", 80, command=2), b"\x05\x00\x05\x07"),
        # unknown address type: 0x08
        (b"\x05\x01\x00\x05\x01\x00\x09", b"\x05\x00\x05\x08"),
        # no acceptable authentication method (only user/password offered): 0xFF
        (b"\x05\x01\x02", b"\x05\xff"),
        # wrong version in the request
        (b"\x05\x01\x00\x04\x01\x00\x01", b"\x05\x00\x05\x01"),
    ],
)
async def test_socks5_refusals_and_protocol_errors(
    proxy_socket: Path, request_bytes: bytes, reply: bytes
) -> None:
    got = await exchange(proxy_socket, request_bytes)
    assert got[: len(reply)] == reply


async def test_socks5_truncated_greeting_just_closes(proxy_socket: Path) -> None:
    assert await exchange(proxy_socket, b"\x05\x02\x00") == b""


# ---- corral run options ------------------------------------------------------------------


def _cli(*argv: str) -> NetworkPolicy:
    from corral.cli import build_policy, make_parser

    args = make_parser().parse_args(["run", *argv, "--", "true"])
    return build_policy(args).network


def test_cli_network_options() -> None:
    assert _cli().mode == "none"
    assert _cli("--network", "full").mode == "full"
    allow = _cli("--allow-host", "pypi.org", "--allow-host", "*.github.com")
    assert (allow.mode, allow.allow_hosts) == ("allowlist", ("pypi.org", "*.github.com"))
    ports = _cli("--allow-port", "8080", "--allow-port", "5432")
    assert (ports.mode, ports.ports) == ("ports", (5432, 8080))
    both = _cli("--allow-host", "a.test", "--allow-port", "8080")
    assert (both.mode, both.ports) == ("allowlist", (8080,))
    assert _cli("--network", "full", "--allow-port", "80").mode == "full"
    with pytest.raises(PolicyError, match="contradicts"):
        _cli("--network", "none", "--allow-host", "a.test")
    with pytest.raises(PolicyError, match="needs --network allowlist"):
        _cli("--network", "full", "--allow-host", "a.test")


# ---- what reaches the upstream server -----------------------------------------------------


class RecordingUpstream:
    """Reads one request (head and Content-Length body), answers, then records every byte
    that still arrives until the proxy closes the connection."""

    def __init__(self) -> None:
        self.received = b""
        self.done = asyncio.Event()
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> RecordingUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            writer.write_eof()  # answered; keep reading to see what else the proxy sends
            self.received = head + body + await reader.read()  # until the proxy closes
        except asyncio.IncompleteReadError as exc:
            self.received = exc.partial
        finally:
            writer.close()
            self.done.set()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def recorder() -> AsyncIterator[RecordingUpstream]:
    up = await RecordingUpstream().start()
    yield up
    await up.close()


async def test_the_host_header_is_the_urls_and_hop_by_hop_headers_are_dropped(
    proxy_socket: Path, recorder: RecordingUpstream
) -> None:
    request = (
        f"GET http://allowed.test:{recorder.port}/v HTTP/1.1\r\n"
        "Host: secret.internal\r\n"  # another virtual host on the allowed address
        "Connection: keep-alive, X-Private\r\nX-Private: token\r\nKeep-Alive: 5\r\n"
        "Proxy-Authorization: Basic Zm9v\r\nProxy-Foo: bar\r\nUpgrade: websocket\r\n"
        "TE: trailers\r\nUser-Agent: t\r\n\r\n"
    )
    reply = await exchange(proxy_socket, request.encode())
    assert reply.startswith(b"HTTP/1.1 200 OK")
    async with asyncio.timeout(10):
        await recorder.done.wait()
    assert (
        recorder.received
        == (
            f"GET /v HTTP/1.1\r\nHost: allowed.test:{recorder.port}\r\nUser-Agent: t\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
    )


@pytest.mark.parametrize(
    ("framing", "body"),
    [
        ("Content-Length: 5", b"hello"),
        ("Transfer-Encoding: chunked", b"5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n"),
    ],
)
async def test_nothing_after_the_request_body_reaches_upstream(
    proxy_socket: Path, recorder: RecordingUpstream, framing: str, body: bytes
) -> None:
    first = (
        f"POST http://allowed.test:{recorder.port}/a HTTP/1.1\r\nHost: allowed.test\r\n"
        f"{framing}\r\n\r\n"
    ).encode() + body
    smuggled = b"GET /admin HTTP/1.1\r\nHost: secret.internal\r\n\r\n"
    reply = await exchange(proxy_socket, first + smuggled)
    assert reply.startswith(b"HTTP/1.1 200 OK")
    async with asyncio.timeout(10):
        await recorder.done.wait()
    assert recorder.received.endswith(body)
    assert b"secret.internal" not in recorder.received


@pytest.mark.parametrize(
    "headers",
    [
        "Content-Length: 5\r\nTransfer-Encoding: chunked",
        "Transfer-Encoding: gzip, chunked",
        "Content-Length: 5\r\nContent-Length: 6",
        "Content-Length: -1",
    ],
)
async def test_ambiguous_request_bodies_are_refused(
    proxy_socket: Path, recorder: RecordingUpstream, headers: str
) -> None:
    request = f"POST http://allowed.test:{recorder.port}/ HTTP/1.1\r\n{headers}\r\n\r\nhello"
    reply = await exchange(proxy_socket, request.encode())
    assert reply.startswith(b"HTTP/1.1 400")
    assert not recorder.done.is_set()


async def test_a_private_address_refusal_names_the_address_and_the_fix(
    proxy_socket: Path,
) -> None:
    reply = await exchange(proxy_socket, b"CONNECT private.test:443 HTTP/1.1\r\n\r\n")
    status_line = reply.partition(b"\r\n")[0].decode()
    assert status_line == (
        "HTTP/1.1 403 corral: private.test resolves to 10.9.9.9, a private address; allow it "
        'with network.allow_private = ["10.9.9.9"] or --allow-private 10.9.9.9'
    )


async def test_refusals_are_kept_for_the_caller(tmp_path: Path) -> None:
    proxy = EgressProxy(
        HostAllowlist(["private.test"]),
        AddressScreen([]),
        StaticResolver({"private.test": "10.1.1.1"}),
    )
    path = tmp_path / "p.sock"
    await proxy.serve(path)
    try:
        await exchange(path, b"CONNECT denied.test:443 HTTP/1.1\r\n\r\n")
        mark = proxy.refusal_count
        await exchange(path, b"GET http://private.test:8080/ HTTP/1.1\r\n\r\n")
        (refusal,) = proxy.refusals_since(mark)
        assert (refusal.host, refusal.port, refusal.protocol, refusal.status) == (
            "private.test",
            8080,
            "http",
            403,
        )
        assert "--allow-private 10.1.1.1" in refusal.reason
        assert [r.host for r in proxy.refusals_since(0)] == ["denied.test", "private.test"]
        assert proxy.refusals_since(proxy.refusal_count) == ()
    finally:
        await proxy.close()


# ---- inside tunnels ------------------------------------------------------------------------


def client_hello(server_name: str | None) -> bytes:
    """A minimal TLS 1.2 ClientHello record (enough for the proxy's look at its SNI)."""
    extensions = b""
    if server_name is not None:
        name = server_name.encode()
        entry = b"\x00" + struct.pack("!H", len(name)) + name
        sni = struct.pack("!H", len(entry)) + entry
        extensions = struct.pack("!HH", 0, len(sni)) + sni
    body = (
        b"\x03\x03"
        + bytes(32)
        + b"\x00"
        + b"\x00\x02\x13\x01"
        + b"\x01\x00"
        + struct.pack("!H", len(extensions))
        + extensions
    )
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


@pytest.mark.parametrize(
    ("name", "passes"),
    [("a.wild.test", True), ("A.Wild.Test.", True), (None, True), ("secret.test", False)],
)
async def test_a_tls_tunnel_must_name_its_own_host(
    proxy_socket: Path,
    recorder: RecordingUpstream,
    audit_path: Path,
    name: str | None,
    passes: bool,
) -> None:
    reader, writer = await asyncio.open_unix_connection(str(proxy_socket))
    writer.write(f"CONNECT a.wild.test:{recorder.port} HTTP/1.1\r\n\r\n".encode())
    hello = client_hello(name)
    async with asyncio.timeout(10):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        # the hello split across writes, as a slow client sends it
        writer.write(hello[:7])
        await writer.drain()
        writer.write(hello[7:] + b"\r\n\r\n")
        writer.write_eof()
        await reader.read()
        await recorder.done.wait()
    writer.close()
    if passes:
        assert recorder.received.startswith(hello)
    else:
        assert recorder.received == b""  # not one byte of the hello reached the server
        last = read_records(audit_path)[-1]
        assert (last["action"], last["host"]) == ("deny", "a.wild.test")
        assert "TLS server name 'secret.test'" in last["reason"]


async def test_plain_http_in_a_tunnel_keeps_to_its_host(
    proxy_socket: Path, upstream: LoopbackHttp, audit_path: Path
) -> None:
    upstream.body = lambda head: head
    reader, writer = await asyncio.open_unix_connection(str(proxy_socket))
    writer.write(f"CONNECT allowed.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
    async with asyncio.timeout(10):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.write(b"GET http://secret.test/x HTTP/1.1\r\nHost: secret.test\r\n\r\n")
        reply = await reader.read()
    writer.close()
    assert reply.startswith(b"HTTP/1.1 200 OK")
    (head,) = upstream.heads
    assert head == f"GET /x HTTP/1.1\r\nHost: allowed.test:{upstream.port}\r\n\r\n".encode()


async def test_other_protocols_pass_a_tunnel_untouched(proxy_socket: Path) -> None:
    seen: list[bytes] = []

    async def speak_first(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"SSH-2.0-server\r\n")  # a server that speaks first
        seen.append(await r.read(100))
        w.close()

    server = await asyncio.start_server(speak_first, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy_socket))
        writer.write(f"CONNECT allowed.test:{port} HTTP/1.1\r\n\r\n".encode())
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            assert await reader.readuntil(b"\r\n") == b"SSH-2.0-server\r\n"
            writer.write(b"SSH-2.0-client\r\n")
            await reader.read()
        writer.close()
        assert seen == [b"SSH-2.0-client\r\n"]
    finally:
        server.close()
        await server.wait_closed()


# ---- hostile bytes into the parsers ----------------------------------------------------------


@given(st.binary(max_size=600))
def test_a_client_hello_parser_never_fails_but_with_value_error(data: bytes) -> None:
    try:
        name = client_hello_sni(b"\x01" + data)
    except ValueError:
        return
    assert name is None or isinstance(name, str)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"X"]), st.binary(max_size=12)
        ),
        max_size=4,
    )
)
def test_body_framing_is_a_length_chunked_or_a_refusal(headers: list[tuple[bytes, bytes]]) -> None:
    framing = body_framing(headers)
    assert isinstance(framing, str) or framing.length is None or framing.length >= 0


def test_the_parsed_server_name_is_the_one_sent() -> None:
    assert client_hello_sni(client_hello("pypi.org")[5:]) == "pypi.org"
    assert client_hello_sni(client_hello(None)[5:]) is None
