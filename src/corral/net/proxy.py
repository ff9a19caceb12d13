"""The egress proxy: HTTP (CONNECT and absolute-form) and SOCKS5 on one listener.

It runs on the host, in the sandbox's event loop, listening on a unix socket that the box
reaches through a loopback forwarder of the guest agent. The first byte of a connection
picks the protocol: ``0x05`` is a SOCKS5 greeting, anything else an HTTP request line.

Every connection goes through :meth:`EgressProxy.open_upstream`, the only place that decides:

1. the requested name (and port) must match ``network.allow_hosts``;
2. the proxy resolves the name itself and keeps only addresses that are public, or covered
   by ``network.allow_private``;
3. it connects to the first of those that answers.

A refusal reaches the program as HTTP 403 with a text body naming the host and the policy
field to change (SOCKS5: reply 0x02, "connection not allowed by ruleset"), and every
decision is written to the sandbox's audit log as a ``network`` record.

Plain HTTP requests are forwarded with ``Connection: close``, so a kept-alive client can
never send a second request, for another host, down a connection opened for the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import struct
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from corral.audit import AuditLog
from corral.models import NetworkRefusal
from corral.net.http import (
    OriginRequest,
    copy_body,
    http_response,
    origin_request,
    parse_request,
    reason_phrase,
)
from corral.net.resolver import ResolveError, Resolver
from corral.net.rules import (
    AddressScreen,
    HostAllowlist,
    IPAddress,
    normalize_host,
    split_host_port,
)
from corral.net.tunnel import Mismatch, police

MAX_HEAD = 64 * 1024
"""Largest request head (request line and headers) the proxy reads."""
RELAY_CHUNK = 256 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0
MAX_REFUSALS = 256
"""Refusals kept for :meth:`EgressProxy.refusals_since` (older ones are dropped)."""

# SOCKS5 reply codes (RFC 1928, section 6).
SOCKS_OK = 0x00
SOCKS_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_REFUSED = 0x05
SOCKS_TTL_EXPIRED = 0x06
SOCKS_BAD_COMMAND = 0x07
SOCKS_BAD_ADDRESS = 0x08


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a connection was not made: an HTTP status, a SOCKS5 code, the full explanation
    (the HTTP body) and its one-line form (the status line's reason phrase)."""

    status: int
    socks: int
    message: str
    summary: str = ""

    def response(self) -> bytes:
        return http_response(self.status, self.message, self.summary or self.message)


@dataclass(frozen=True, slots=True)
class Tunnel:
    """A CONNECT or SOCKS5 tunnel to ``host:port`` (as the client named it)."""

    host: str
    port: int
    protocol: str


NO_ROUTE = Tunnel("", 0, "")


def mismatch(name: str, port: int, what: str) -> Refusal:
    return Refusal(
        403,
        SOCKS_NOT_ALLOWED,
        f"corral: tunnel to {name}:{port} closed: {what}. A tunnel carries only the host it "
        "was opened for (another name on the same address would bypass network.allow_hosts).",
        f"corral: tunnel to {name}:{port} closed: {what}",
    )


def not_listed(name: str, port: int) -> Refusal:
    return Refusal(
        403,
        SOCKS_NOT_ALLOWED,
        f"corral: connection to {name}:{port} refused: the host is not in "
        f"network.allow_hosts. To allow it, add {name!r} (or '{name}:{port}') to "
        f"network.allow_hosts in the policy, or pass `--allow-host {name}` to `corral run`.",
        f"corral: {name}:{port} is not in network.allow_hosts; allow it with --allow-host {name}",
    )


def socks_reply(code: int) -> bytes:
    return struct.pack("!BBBB4sH", 5, code, 0, 1, b"\0\0\0\0", 0)


class UnixService:
    """A host-side server on a unix socket brought into a box; ``close()`` ends every
    connection it is relaying."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class EgressProxy(UnixService):
    """One box's proxy. ``serve(path)`` starts it, ``close()`` ends every connection."""

    def __init__(
        self,
        allowlist: HostAllowlist,
        screen: AddressScreen,
        resolver: Resolver,
        audit: AuditLog | None = None,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.allowlist = allowlist
        self.screen = screen
        self.resolver = resolver
        self.audit = audit
        self.connect_timeout = connect_timeout
        self._refusals: deque[NetworkRefusal] = deque(maxlen=MAX_REFUSALS)
        self.refusal_count = 0
        """Refusals so far: a mark for :meth:`refusals_since`."""
        super().__init__()

    # ---- lifecycle -----------------------------------------------------------------------
    async def serve(self, path: Path) -> None:
        """Listen on ``path`` (owned by the caller's ids, not writable by others: the caller
        grants the box access, :meth:`corral.net.BoxNetwork.start`)."""
        self._server = await asyncio.start_unix_server(self._handle, path=str(path), limit=MAX_HEAD)

    def refusals_since(self, mark: int) -> tuple[NetworkRefusal, ...]:
        """What was refused after ``refusal_count`` was ``mark`` (at most the last
        :data:`MAX_REFUSALS`)."""
        wanted = min(self.refusal_count - mark, len(self._refusals))
        return tuple(self._refusals)[len(self._refusals) - wanted :] if wanted > 0 else ()

    # ---- the decision --------------------------------------------------------------------
    def _record(self, action: str, protocol: str, host: str, port: int, **extra: object) -> None:
        if self.audit is not None:
            self.audit.record(
                "network", action=action, protocol=protocol, host=host, port=port, **extra
            )

    def _deny(self, protocol: str, host: str, port: int, refusal: Refusal) -> Refusal:
        action = "deny" if refusal.status in (400, 403) else "error"
        self._record(action, protocol, host, port, reason=refusal.message)
        self._refusals.append(
            NetworkRefusal(
                host=host,
                port=port,
                protocol=protocol,
                status=refusal.status,
                reason=reason_phrase(refusal.summary or refusal.message),
            )
        )
        self.refusal_count += 1
        return refusal

    async def open_upstream(
        self, host: str, port: int, protocol: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | Refusal:
        """Apply the policy to ``host:port`` and connect, or say why not."""
        try:
            name = normalize_host(host)
        except ValueError as exc:
            return self._deny(protocol, host, port, Refusal(400, SOCKS_BAD_ADDRESS, str(exc)))
        if not self.allowlist.allows(name, port):
            return self._deny(protocol, name, port, not_listed(name, port))
        try:
            addresses = await self._resolve(name, port)
        except (ResolveError, TimeoutError) as exc:
            message = f"corral: {exc}" if str(exc) else f"corral: resolving {name} timed out"
            return self._deny(protocol, name, port, Refusal(502, SOCKS_HOST_UNREACHABLE, message))
        permitted = [a for a in addresses if self.screen.refusal(a) is None]
        if not permitted:
            return self._deny(protocol, name, port, self._private(name, port, addresses))
        return await self._connect(name, port, protocol, permitted)

    def _private(self, name: str, port: int, addresses: list[IPAddress]) -> Refusal:
        shown = addresses[:4]
        kinds = sorted({self.screen.refusal(a) or "" for a in shown})
        listed = ", ".join(f'"{a}"' for a in shown)
        flags = " ".join(f"--allow-private {a}" for a in shown)
        where = f"resolves to {shown[0]}" if len(addresses) == 1 else f"resolves only to {listed}"
        if str(shown[0]) == name:
            where = "is"
        summary = (
            f"corral: {name} {where}, a {'/'.join(kinds)} address; "
            f"allow it with network.allow_private = [{listed}] or {flags}"
        )
        message = (
            f"corral: connection to {name}:{port} refused: {name} {where}, a "
            f"{' / '.join(kinds)} address, and private, loopback, link-local and reserved "
            "addresses are closed unless the policy opens them (a name can point anywhere, "
            "and some networks resolve public registries to such addresses). If you trust "
            f"this address, add network.allow_private = [{listed}] to the policy, or pass "
            f"`{flags}` to `corral run`."
        )
        return Refusal(403, SOCKS_NOT_ALLOWED, message, summary)

    async def _resolve(self, name: str, port: int) -> list[IPAddress]:
        try:
            return [ipaddress.ip_address(name)]
        except ValueError:
            pass
        async with asyncio.timeout(self.connect_timeout):
            return await self.resolver.resolve(name, port)

    async def _connect(
        self, name: str, port: int, protocol: str, addresses: list[IPAddress]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | Refusal:
        last = ""
        timed_out = False
        for address in addresses:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(
                        str(address), port, limit=RELAY_CHUNK
                    )
            except TimeoutError:
                timed_out, last = True, f"{address}: timed out"
                continue
            except OSError as exc:
                last = f"{address}: {exc.strerror or exc}"
                continue
            self._record("allow", protocol, name, port, address=str(address))
            return reader, writer
        status, code = (504, SOCKS_TTL_EXPIRED) if timed_out else (502, SOCKS_REFUSED)
        message = f"corral: cannot connect to {name}:{port} ({last})"
        return self._deny(protocol, name, port, Refusal(status, code, message))

    # ---- connections ---------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                first = await reader.readexactly(1)
                route: OriginRequest | Tunnel
                if first == b"\x05":
                    upstream, route = await self._socks5(reader, writer)
                else:
                    upstream, route = await self._http(first, reader, writer)
            if upstream is None:
                pass
            elif isinstance(route, OriginRequest):
                await forward_request(route, reader, writer, *upstream)
            else:
                await self._tunnel(route, reader, writer, *upstream)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _http(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, OriginRequest | Tunnel]:
        """The upstream connection, and the request to forward on it or the tunnel's host."""
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            writer.write(http_response(431, "corral: request head larger than 64 KiB"))
            return None, NO_ROUTE
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                writer.write(http_response(400, "corral: incomplete HTTP request"))
            return None, NO_ROUTE
        request = parse_request(head)
        if isinstance(request, str):
            writer.write(http_response(400, f"corral: {request}"))
            return None, NO_ROUTE
        method, target, headers = request
        if method == "CONNECT":
            try:
                host, port = split_host_port(target)
            except ValueError as exc:
                writer.write(http_response(400, f"corral: bad CONNECT target: {exc}"))
                return None, NO_ROUTE
            result = await self.open_upstream(host, port, "connect")
            if isinstance(result, Refusal):
                writer.write(result.response())
                return None, NO_ROUTE
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            return result, Tunnel(host, port, "connect")
        forward = origin_request(method, target, headers)
        if isinstance(forward, str):
            writer.write(http_response(400, f"corral: {forward}"))
            return None, NO_ROUTE
        result = await self.open_upstream(forward.host, forward.port, "http")
        if isinstance(result, Refusal):
            writer.write(result.response())
            return None, NO_ROUTE
        result[1].write(forward.head)
        return result, forward

    async def _tunnel(
        self,
        route: Tunnel,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        upstream_r: asyncio.StreamReader,
        upstream_w: asyncio.StreamWriter,
    ) -> None:
        """Relay a tunnel, holding TLS and HTTP inside it to its host (:mod:`.tunnel`)."""
        name = normalize_host(route.host)  # it passed open_upstream
        try:
            ipaddress.ip_address(name)
        except ValueError:
            pass
        else:  # the policy named the address itself
            await relay(client_r, client_w, upstream_r, upstream_w)
            return

        async def upward() -> None:
            try:
                await police(name, route.port, client_r, upstream_w, RELAY_CHUNK)
            except Mismatch as exc:
                self._deny(route.protocol, name, route.port, mismatch(name, route.port, str(exc)))
                upstream_w.close()
                client_w.close()
            except (ValueError, asyncio.IncompleteReadError, OSError):
                upstream_w.close()

        try:
            await asyncio.gather(upward(), _pipe(upstream_r, client_w, upstream_w))
        finally:
            upstream_w.close()
            with contextlib.suppress(OSError):
                await upstream_w.wait_closed()

    async def _socks5(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, Tunnel]:
        (count,) = await reader.readexactly(1)
        methods = await reader.readexactly(count)
        if 0 not in methods:
            writer.write(b"\x05\xff")  # no acceptable method: corral asks for no auth
            return None, NO_ROUTE
        writer.write(b"\x05\x00")
        version, command, _reserved, kind = await reader.readexactly(4)
        if version != 5:
            writer.write(socks_reply(SOCKS_FAILURE))
            return None, NO_ROUTE
        if kind == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        elif kind == 4:
            host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
        elif kind == 3:
            (length,) = await reader.readexactly(1)
            host = (await reader.readexactly(length)).decode("ascii", errors="replace")
        else:
            writer.write(socks_reply(SOCKS_BAD_ADDRESS))
            return None, NO_ROUTE
        (port,) = struct.unpack("!H", await reader.readexactly(2))
        if command != 1:  # only CONNECT: no BIND, no UDP ASSOCIATE
            self._record("deny", "socks5", host, port, reason=f"unsupported command {command}")
            writer.write(socks_reply(SOCKS_BAD_COMMAND))
            return None, NO_ROUTE
        if port == 0:
            writer.write(socks_reply(SOCKS_BAD_ADDRESS))
            return None, NO_ROUTE
        result = await self.open_upstream(host, port, "socks5")
        if isinstance(result, Refusal):
            writer.write(socks_reply(result.socks))
            return None, NO_ROUTE
        writer.write(socks_reply(SOCKS_OK))
        return result, Tunnel(host, port, "socks5")


async def _pipe(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, other: asyncio.StreamWriter
) -> None:
    try:
        while data := await src.read(RELAY_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        # One side broke: end both, so the other direction does not wait forever.
        dst.close()
        other.close()


async def forward_request(
    request: OriginRequest,
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    upstream_r: asyncio.StreamReader,
    upstream_w: asyncio.StreamWriter,
) -> None:
    """Send one request's body upstream (its head is sent) and the answer back; whatever the
    client sends after the body is never forwarded."""

    async def send() -> None:
        try:
            await copy_body(request.framing, client_r, upstream_w, RELAY_CHUNK)
        except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            upstream_w.close()  # a broken body ends the exchange

    sender = asyncio.create_task(send())
    try:
        await _pipe(upstream_r, client_w, upstream_w)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        upstream_w.close()


async def relay(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    upstream_r: asyncio.StreamReader,
    upstream_w: asyncio.StreamWriter,
) -> None:
    """Copy both ways until both sides are done (half-closes are passed on)."""
    try:
        await asyncio.gather(
            _pipe(client_r, upstream_w, client_w), _pipe(upstream_r, client_w, upstream_w)
        )
    finally:
        upstream_w.close()
        with contextlib.suppress(OSError):
            await upstream_w.wait_closed()
