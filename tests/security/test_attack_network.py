"""Network escapes: every egress path from a box with network.mode 'none' (the default), raw and
packet sockets, host unix and abstract sockets, and the per-mode checks of the other modes
(skipped, with the reason, where a backend does not wire a mode yet)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.errors import SandboxError
from corral.net import StaticResolver
from loopback_http import LoopbackHttp
from security.helpers import box_py, gvisor

pytestmark = [pytest.mark.attack("network"), pytest.mark.needs_bwrap]


class HostServer:
    """A host listener that counts connections (any connection from the box is an escape)."""

    def __init__(self, family: int, address: object, kind: int = socket.SOCK_STREAM) -> None:
        self.sock = socket.socket(family, kind)
        self.sock.bind(address)  # type: ignore[arg-type]
        self.kind = kind
        if kind == socket.SOCK_STREAM:
            self.sock.listen()
        self.sock.settimeout(0.2)
        self.hits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self.kind == socket.SOCK_STREAM:
                    conn, _ = self.sock.accept()
                    conn.close()
                else:
                    self.sock.recv(100)
            except TimeoutError:
                continue
            except OSError:
                return
            if self._stop.is_set():
                return  # woken by close(), not by a client
            self.hits += 1

    def close(self) -> None:
        """Stop at once: a connection (or a datagram) of its own wakes the thread, so the
        join does not hold the test's event loop for up to the 0.2 s poll (the loop watch
        failed the test's last step for it)."""
        self._stop.set()
        with contextlib.suppress(OSError), socket.socket(self.sock.family, self.kind) as poke:
            # shutdown() wakes neither a unix listener's accept() nor a datagram recv()
            if self.kind == socket.SOCK_STREAM:
                poke.connect(self.sock.getsockname())
            else:
                poke.sendto(b"", self.sock.getsockname())
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def tcp_server() -> Iterator[HostServer]:
    srv = HostServer(socket.AF_INET, ("127.0.0.1", 0))
    yield srv
    srv.close()


CONNECT = (
    "import socket\n"
    "def connect(family, addr, kind=socket.SOCK_STREAM):\n"
    "    s = socket.socket(family, kind)\n"
    "    s.settimeout(3)\n"
    "    try:\n"
    "        s.connect(addr)\n"
    "        return 'CONNECTED'\n"
    "    except OSError as e:\n"
    "        return errno.errorcode.get(e.errno, str(e))\n"
    "    finally:\n"
    "        s.close()\n"
)


async def test_host_loopback_tcp(sandbox: Sandbox, tcp_server: HostServer) -> None:
    code = CONNECT + f"res = connect(socket.AF_INET, ('127.0.0.1', {tcp_server.port}))"
    assert await box_py(sandbox, code) == "ECONNREFUSED"
    assert tcp_server.hits == 0


async def test_host_loopback_ipv6(sandbox: Sandbox) -> None:
    try:
        srv = HostServer(socket.AF_INET6, ("::1", 0))
    except OSError:
        pytest.skip("the host has no IPv6 loopback")
    try:
        code = CONNECT + f"res = connect(socket.AF_INET6, ('::1', {srv.port}))"
        assert await box_py(sandbox, code) in ("ECONNREFUSED", "EADDRNOTAVAIL", "ENETUNREACH")
        assert srv.hits == 0
    finally:
        srv.close()


async def test_host_loopback_udp(sandbox: Sandbox) -> None:
    srv = HostServer(socket.AF_INET, ("127.0.0.1", 0), socket.SOCK_DGRAM)
    try:
        code = (
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"res = [s.sendto(b'leak', ('127.0.0.1', {srv.port})) for _ in range(5)]"
        )
        await box_py(sandbox, "import socket\n" + code)
        # The datagrams went to the box's own loopback: a later host datagram proves the
        # listener was live while nothing from the box arrived.
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.sendto(b"host", ("127.0.0.1", srv.port))
        probe.close()
        srv.close()
        assert srv.hits <= 1
    finally:
        srv.close()


@pytest.mark.parametrize("addr", [("1.1.1.1", 53), ("10.0.2.2", 80), ("169.254.169.254", 80)])
async def test_outside_addresses(sandbox: Sandbox, addr: tuple[str, int]) -> None:
    code = CONNECT + f"res = connect(socket.AF_INET, {addr!r})"
    # gVisor's network stack, with no route either, answers EHOSTUNREACH.
    assert await box_py(sandbox, code) in (
        {"ENETUNREACH", "EHOSTUNREACH"} if gvisor(sandbox) else {"ENETUNREACH"}
    )


async def test_dns_resolution(sandbox: Sandbox) -> None:
    code = "import socket\nres = err(socket.getaddrinfo, 'example.com', 443) or 'RESOLVED'"
    r = await box_py(
        sandbox,
        "import socket\ntry:\n    socket.getaddrinfo('example.com', 443)\n"
        "    res = 'RESOLVED'\nexcept socket.gaierror as e:\n    res = 'failed'",
    )
    assert r == "failed" and code


@pytest.mark.parametrize(
    ("family", "kind", "proto"),
    [(2, 3, 1), (17, 3, 0x0300), (2, 10, 0)],  # raw ICMP, AF_PACKET, SOCK_PACKET
    ids=["raw-icmp", "af-packet", "sock-packet"],
)
async def test_raw_and_packet_sockets(sandbox: Sandbox, family: int, kind: int, proto: int) -> None:
    code = f"import socket\nres = err(socket.socket, {family}, {kind}, {proto})"
    refused = {"EPERM", "EACCES", "EINVAL", "ESOCKTNOSUPPORT"}
    # gVisor has no obsolete SOCK_PACKET at all.
    assert await box_py(sandbox, code) in refused | (
        {"EPROTONOSUPPORT"} if gvisor(sandbox) else set()
    )


async def test_create_network_interfaces(sandbox: Sandbox) -> None:
    r = await sandbox.run(
        "ip link add corral0 type dummy; ip link set lo down; ip route add default dev lo"
    )
    denied = r.stderr.count("Operation not permitted") + r.stderr.count("Permission denied")
    assert denied >= 2, r.stderr
    assert "corral0" not in (await sandbox.run("ip link")).stdout


@pytest.mark.parametrize("where", ["/tmp", "/run"])
async def test_host_unix_sockets_in_private_dirs(sandbox: Sandbox, where: str) -> None:
    if where == "/run" and os.geteuid() != 0:
        pytest.skip(
            "rootless: an ordinary user cannot make a socket in /run; the box's /run is its "
            "own either way, and the /tmp case tries a socket the user made"
        )
    base = Path(where) / f"corral-sec-{secrets.token_hex(4)}"
    base.mkdir(mode=0o777)
    path = str(base / "host.sock")
    srv = HostServer(socket.AF_UNIX, path)
    os.chmod(path, 0o777)
    try:
        code = CONNECT + f"res = connect(socket.AF_UNIX, {path!r})"
        assert await box_py(sandbox, code) == "ENOENT"
        assert srv.hits == 0
    finally:
        srv.close()
        os.unlink(path)
        base.rmdir()


async def test_host_abstract_unix_socket(sandbox: Sandbox) -> None:
    name = f"\0corral-sec-{secrets.token_hex(4)}"
    srv = HostServer(socket.AF_UNIX, name)
    try:
        code = CONNECT + f"res = connect(socket.AF_UNIX, {name!r})"
        assert await box_py(sandbox, code) == "ECONNREFUSED"
        assert srv.hits == 0
    finally:
        srv.close()


# ---- the other network modes ------------------------------------------------------------


@contextlib.asynccontextmanager
async def _started_or_skip(policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    sb = Sandbox(policy, workspace=workspace)
    try:
        await sb.start()
    except SandboxError as exc:
        pytest.skip(f"network.mode {policy.network.mode!r} unavailable here: {exc.message}")
    try:
        yield sb
    finally:
        await sb.aclose()


async def test_ports_mode_exposes_only_the_listed_port(box_policy: Policy, workspace: Path) -> None:
    allowed = HostServer(socket.AF_INET, ("127.0.0.1", 0))
    other = HostServer(socket.AF_INET, ("127.0.0.1", 0))
    policy = box_policy.model_copy(
        update={
            "network": box_policy.network.model_copy(
                update={"mode": "ports", "ports": (allowed.port,)}
            )
        }
    )
    try:
        async with _started_or_skip(policy, workspace) as sb:
            code = CONNECT + (
                f"res = [connect(socket.AF_INET, ('127.0.0.1', {allowed.port})),"
                f" connect(socket.AF_INET, ('127.0.0.1', {other.port}))]"
            )
            ok, refused = await box_py(sb, code)
            if ok != "CONNECTED":
                pytest.skip(f"ports mode does not reach the listed port on this backend ({ok})")
            assert refused in ("ECONNREFUSED", "ENETUNREACH")
        assert other.hits == 0
    finally:
        allowed.close()
        other.close()


async def test_full_mode_blocks_host_and_private_ranges(
    box_policy: Policy, workspace: Path, tcp_server: HostServer
) -> None:
    policy = box_policy.model_copy(
        update={"network": box_policy.network.model_copy(update={"mode": "full"})}
    )
    async with _started_or_skip(policy, workspace) as sb:
        links = (await sb.run("cat /proc/net/dev")).stdout
        if not [ln for ln in links.splitlines()[2:] if ln.split(":")[0].strip() != "lo"]:
            pytest.skip("full mode gives this backend's boxes no interface yet")
        route = (await sb.run("cat /proc/net/route")).stdout.splitlines()[1:]
        gateways = {socket.inet_ntoa(bytes.fromhex(f[2])[::-1]) for f in map(str.split, route)}
        targets = [*sorted(gateways - {"0.0.0.0"}), "10.0.2.2", "169.254.169.254", "192.168.0.1"]
        code = CONNECT + (
            f"res = [connect(socket.AF_INET, (h, {tcp_server.port})) for h in {targets!r}]"
        )
        results = await box_py(sb, code, timeout=30)
        assert "CONNECTED" not in results, dict(zip(targets, results, strict=True))
    assert tcp_server.hits == 0


async def test_allowlist_mode_refuses_other_hosts(
    box_policy: Policy, workspace: Path, tcp_server: HostServer
) -> None:
    policy = box_policy.model_copy(
        update={
            "network": box_policy.network.model_copy(
                update={"mode": "allowlist", "allow_hosts": ("pypi.org",)}
            )
        }
    )
    async with _started_or_skip(policy, workspace) as sb:
        env = (await sb.run("env")).stdout
        proxy = next(
            (
                ln.split("=", 1)[1]
                for ln in env.splitlines()
                if ln.lower().startswith("https_proxy=")
            ),
            None,
        )
        if not proxy:
            pytest.skip("allowlist mode sets no proxy in this backend's boxes yet")
        hostport = proxy.rstrip("/").rsplit("/", 1)[-1]
        host, port = hostport.rsplit(":", 1)
        code = (
            "import socket\n"
            f"s = socket.create_connection(({host!r}, {int(port)}), timeout=5)\n"
            f"s.sendall(b'CONNECT 127.0.0.1:{tcp_server.port} HTTP/1.1\\r\\n"
            f"Host: 127.0.0.1:{tcp_server.port}\\r\\n\\r\\n')\n"
            "res = s.recv(200).decode(errors='replace').split('\\r\\n')[0]"
        )
        status = await box_py(sb, code)
        assert " 200" not in status, status
    assert tcp_server.hits == 0


# ---- the egress proxy: virtual hosts, other local users -----------------------------------


def _allowlist(policy: Policy, ports: tuple[int, ...] = ()) -> Policy:
    network = policy.network.model_copy(
        update={
            "mode": "allowlist",
            "allow_hosts": ("allowed.test",),
            "allow_private": ("127.0.0.1",),
            "ports": ports,
        }
    )
    return policy.model_copy(update={"network": network})


def _host_of(head: bytes) -> bytes:
    """The body of the vhost server: which Host the request named."""
    for line in head.split(b"\r\n")[1:]:
        if line.lower().startswith(b"host:"):
            return b"vhost " + line.split(b":", 1)[1].strip() + b"\n"
    return b"vhost none\n"


HOST_VARIANTS = (
    # (request line target, header lines): each names secret.test some other way
    ("http://allowed.test:{port}/", "HOST: secret.test"),
    ("http://allowed.test:{port}/", "Host: allowed.test\r\nHost: secret.test"),
    ("http://allowed.test:{port}/", "Host:\tsecret.test"),
    ("http://allowed.test:{port}/", "Host: allowed.test\r\n secret.test"),
    ("http://allowed.test:{port}/", "X-Forwarded-Host: secret.test\r\nForwarded: host=secret.test"),
    ("http://secret.test@allowed.test:{port}/", ""),
    ("http://allowed.test:{port}@secret.test/", ""),
    ("http://allowed.test:{port}#@secret.test/", ""),
    ("HTTP://ALLOWED.TEST:{port}/", "Host: secret.test"),
    ("http://allowed.test.:{port}/", "Host: secret.test"),
    ("/", "Host: secret.test"),
    ("http://allowed.test:{port}/\nHost: secret.test", ""),
)


async def test_no_spelling_of_host_reaches_another_virtual_host(
    box_policy: Policy, workspace: Path
) -> None:
    """Host header variants through the proxy by hand (case, duplicates, a tab, a folded
    line, forwarding headers, userinfo and fragments in an absolute-form target, a trailing
    dot, origin form, a bare LF): the server behind an allowed address never sees another
    name (every request head it received is kept and checked)."""
    vhosts = await LoopbackHttp(_host_of).start()
    port = vhosts.port
    names = StaticResolver({"allowed.test": "127.0.0.1"})
    requests = [
        (f"GET {target.format(port=port)} HTTP/1.1\r\n" + (f"{extra}\r\n" if extra else ""))
        + "Connection: close\r\n\r\n"
        for target, extra in HOST_VARIANTS
    ]
    code = (
        "import os, socket\n"
        f"reqs = {requests!r}\n"
        "port = int(os.environ['CORRAL_PROXY'].rsplit(':', 1)[1])\n"
        "res = []\n"
        "for req in reqs:\n"
        "    s = socket.create_connection(('127.0.0.1', port), timeout=10)\n"
        "    s.sendall(req.encode())\n"
        "    data = b''\n"
        "    while chunk := s.recv(65536):\n"
        "        data += chunk\n"
        "    res.append(data.decode(errors='replace'))\n"
        "    s.close()"
    )
    try:
        async with Sandbox(_allowlist(box_policy), workspace=workspace, resolver=names) as sb:
            replies = await box_py(sb, code, timeout=60)
    finally:
        await vhosts.close()
    assert len(replies) == len(HOST_VARIANTS)
    leaked = [h for h in vhosts.heads if b"secret" in h.lower()]
    assert leaked == [], leaked
    assert not any("vhost secret" in r for r in replies), replies
    assert vhosts.hits > 0  # the allowed host itself was reached: the proxy was tried


async def test_an_allowed_address_does_not_open_its_other_virtual_hosts(
    box_policy: Policy, workspace: Path
) -> None:
    vhosts = await LoopbackHttp(_host_of).start()
    port = vhosts.port
    names = StaticResolver({"allowed.test": "127.0.0.1"})
    try:
        async with Sandbox(_allowlist(box_policy), workspace=workspace, resolver=names) as sb:
            r = await sb.run(
                f"curl -sS -H 'Host: secret.test' http://allowed.test:{port}/", timeout=20
            )
            assert r.stdout == f"vhost allowed.test:{port}\n", (r.stdout, r.stderr)
            # By hand: a forged Host, then a second request smuggled after the first.
            code = (
                "import os, socket\n"
                "s = socket.create_connection(('127.0.0.1', int(os.environ['CORRAL_PROXY']"
                ".rsplit(':', 1)[1])), timeout=10)\n"
                f"s.sendall(b'GET http://allowed.test:{port}/ HTTP/1.1\\r\\nHost: secret.test"
                "\\r\\nContent-Length: 0\\r\\n\\r\\n"
                "GET / HTTP/1.1\\r\\nHost: secret.test\\r\\n\\r\\n')\n"
                "data = b''\n"
                "while chunk := s.recv(65536):\n"
                "    data += chunk\n"
                "res = data.decode(errors='replace')"
            )
            reply = await box_py(sb, code)
            assert reply.endswith(f"vhost allowed.test:{port}\n"), reply
            # Through a CONNECT tunnel (curl -p) and a SOCKS5 one, plain HTTP inside.
            for flags in ("-p", "--proxy $ALL_PROXY"):
                r = await sb.run(
                    f"curl -sS {flags} -H 'Host: secret.test' -H 'X-Forwarded-Host: secret.test'"
                    f" -H 'Forwarded: host=secret.test' http://allowed.test:{port}/",
                    timeout=20,
                )
                assert r.stdout == f"vhost allowed.test:{port}\n", (flags, r.stdout, r.stderr)
            # TLS naming another server than the tunnel's host: closed before it is sent.
            tls = (
                "import os, socket, ssl\n"
                "s = socket.create_connection(('127.0.0.1', int(os.environ['CORRAL_PROXY']"
                ".rsplit(':', 1)[1])), timeout=10)\n"
                f"s.sendall(b'CONNECT allowed.test:{port} HTTP/1.1\\r\\n\\r\\n')\n"
                "assert s.recv(100).startswith(b'HTTP/1.1 200')\n"
                "ctx = ssl.create_default_context()\n"
                "try:\n"
                "    ctx.wrap_socket(s, server_hostname='secret.test')\n"
                "    res = 'handshake'\n"
                "except (OSError, ssl.SSLError) as e:\n"
                "    res = type(e).__name__"
            )
            r = await sb.run(["python3", "-c", tls + "\nprint(res)"], timeout=20)
            assert "handshake" not in r.stdout
            assert any("TLS server name 'secret.test'" in x.reason for x in r.network_refusals)
        assert vhosts.heads, "the allowed host was never reached"
        assert not [h for h in vhosts.heads if b"secret.test" in h], vhosts.heads
    finally:
        await vhosts.close()


def _connect_as_nobody(paths: list[str]) -> list[str]:
    """Try every unix socket as uid/gid 65534 (another local user); errno names or OK."""
    code = (
        "import errno, socket, sys\n"
        "for p in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n"
        "        s.connect(p); print('CONNECTED')\n"
        "    except OSError as e:\n"
        "        print(errno.errorcode.get(e.errno, str(e)))\n"
    )
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    proc = subprocess.run(
        [*argv, sys.executable, "-I", "-c", code, *paths],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return proc.stdout.split()


async def test_another_local_user_cannot_reach_the_boxs_network_sockets(
    box_policy: Policy, workspace: Path
) -> None:
    exposed = HostServer(socket.AF_INET, ("127.0.0.1", 0))
    names = StaticResolver({"allowed.test": "127.0.0.1"})
    policy = _allowlist(box_policy, ports=(exposed.port,))
    try:
        async with Sandbox(policy, workspace=workspace, resolver=names) as sb:
            assert sb._network is not None
            net = sb._network
            sockets = sorted(str(p) for p in net.guest_dir.iterdir() if p.is_socket())
            assert len(sockets) == 2, sockets  # the proxy and the port relay
            if os.geteuid() != 0:
                # Rootless: this process cannot become another user to try. The sockets are
                # 0666 (box root is a subordinate id) in the user's own 0700 state directory,
                # which no other user may enter: that directory is checked instead.
                for path in sockets:
                    closed = [
                        d
                        for d in Path(path).parents
                        if d.stat().st_uid == os.getuid()
                        and stat.S_IMODE(d.stat().st_mode) & 0o077 == 0
                    ]
                    assert closed, path
            else:
                got = await asyncio.to_thread(_connect_as_nobody, sockets)
                assert got == ["EACCES", "EACCES"]
                # not by the mode alone: the directory above the sockets is closed too
                assert stat.S_IMODE(net.host_dir.stat().st_mode) == 0o700
                for path in sockets:
                    assert stat.S_IMODE(os.stat(path).st_mode) & 0o007 == 0, path
            # ... while the box itself still gets through
            r = await sb.run("curl -sS -o /dev/null -w '%{http_code}' http://denied.test/")
            assert r.stdout == "403", r.stderr
        assert exposed.hits == 0
    finally:
        exposed.close()
