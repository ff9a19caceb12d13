"""What may travel inside a tunnel (CONNECT, SOCKS5) to a host the policy allowed by name.

The policy allows a *name*; the tunnel reaches an *address*, and one address serves many
names. Two protocols say in their first bytes which name they want, and the proxy holds them
to the tunnel's:

- TLS: the ClientHello's server name (SNI) must be the tunnel's host. A different one (a
  CDN's other customer, another virtual host of the allowed address) ends the tunnel before
  a byte of it reaches the server. What is inside the encrypted stream (its ``Host``) is the
  server's to check against the name it presented a certificate for.
- plain HTTP/1.x: every request's ``Host`` is rewritten to the tunnel's host and an
  absolute-form target to origin-form (a server prefers the URL's host to ``Host``); each
  request's body is forwarded by its framing, so no request hides in another's body.

Anything else (SSH, a database protocol) is relayed as it is: the allowed host and port are
all the policy speaks of. Tunnels to an IP literal are not checked either: the policy named
the address itself. The server's direction is always relayed untouched and at once (some
protocols speak first).
"""

from __future__ import annotations

import asyncio
import re
import struct

from corral.net.http import HOST_OVERRIDES, body_framing, copy_body, parse_request
from corral.net.rules import normalize_host

MAX_HELLO = 64 * 1024
_METHOD = re.compile(rb"[A-Z]{3,12} ")


class Mismatch(Exception):
    """The tunnel's traffic names another host (the message says which)."""


def client_hello_sni(data: bytes) -> str | None:
    """The server name of a complete TLS ClientHello handshake message (``data`` starts at
    the handshake header), or None when it sends none. ValueError if malformed."""
    try:
        if data[0] != 1:
            raise ValueError("not a ClientHello")
        pos = 4 + 2 + 32  # handshake header, client_version, random
        pos += 1 + data[pos]  # session id
        pos += 2 + struct.unpack_from("!H", data, pos)[0]  # cipher suites
        pos += 1 + data[pos]  # compression methods
        if pos == len(data):
            return None  # no extensions at all
        end = pos + 2 + struct.unpack_from("!H", data, pos)[0]
        pos += 2
        while pos + 4 <= end:
            kind, size = struct.unpack_from("!HH", data, pos)
            pos += 4
            if kind == 0:  # server_name: list length, then (type, length, name)
                name_type, length = struct.unpack_from("!BH", data, pos + 2)
                if name_type != 0:
                    raise ValueError("unknown server name type")
                return data[pos + 5 : pos + 5 + length].decode("ascii")
            pos += size
        return None
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed ClientHello: {exc}") from None


class Source:
    """The client's side of a tunnel with a look-ahead buffer: what was read to recognise
    the protocol is read again by whatever handles it."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = b""
        self.eof = False

    async def fill(self, size: int) -> bytes:
        """At least ``size`` bytes (fewer only at EOF), without consuming them."""
        while len(self._buffer) < size and not self.eof:
            data = await self._reader.read(MAX_HELLO)
            self._buffer += data
            self.eof = not data
        return self._buffer

    async def read(self, size: int = -1) -> bytes:
        if not self._buffer:
            return await self._reader.read(size)
        if size < 0:
            size = len(self._buffer)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    async def readexactly(self, size: int) -> bytes:
        data = await self.fill(size)
        if len(data) < size:
            raise asyncio.IncompleteReadError(data, size)
        self._buffer = data[size:]
        return data[:size]

    async def readuntil(self, separator: bytes = b"\n", limit: int = MAX_HELLO) -> bytes:
        while (end := self._buffer.find(separator)) < 0:
            if len(self._buffer) > limit:
                raise Mismatch(f"more than {limit} bytes without {separator!r}")
            if self.eof:
                raise asyncio.IncompleteReadError(self._buffer, None)
            await self.fill(len(self._buffer) + 1)
        end += len(separator)
        data, self._buffer = self._buffer[:end], self._buffer[end:]
        return data


async def client_hello(source: Source) -> bytes:
    """The ClientHello handshake message at the start of ``source``, reassembled from its
    records, without consuming anything. ValueError if it is not one."""
    message = b""
    offset = 0
    while True:
        data = await source.fill(offset + 5)
        if len(data) < offset + 5 or data[offset] != 0x16:
            raise ValueError("not a TLS handshake record")
        length = struct.unpack_from("!H", data, offset + 3)[0]
        data = await source.fill(offset + 5 + length)
        if len(data) < offset + 5 + length:
            raise ValueError("a truncated TLS record")
        message += data[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if len(message) >= 4:
            need = 4 + int.from_bytes(message[1:4], "big")
            if need > MAX_HELLO:
                raise ValueError("a ClientHello larger than 64 KiB")
            if len(message) >= need:
                return message[:need]


def authority(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == 80 else f"{shown}:{port}"


async def police(
    host: str, port: int, client: asyncio.StreamReader, upstream: asyncio.StreamWriter, chunk: int
) -> None:
    """Copy the client's side of a tunnel to ``upstream``, holding TLS and HTTP to ``host``
    (raises :class:`Mismatch` before forwarding a byte that names another host)."""
    source = Source(client)
    first = await source.fill(1)
    if not first:
        return
    if first[0] == 0x16:
        try:
            sni = client_hello_sni(await client_hello(source))
        except ValueError:
            sni = None  # not ours to judge: the server refuses a broken hello
        if sni is not None and _name(sni) != host:
            raise Mismatch(f"the TLS server name {sni!r} is not the tunnel's host {host}")
    elif _looks_like_http(await _start(source)):
        await _http_requests(host, port, source, upstream, chunk)
        return
    while data := await source.read(chunk):
        upstream.write(data)
        await upstream.drain()
    if upstream.can_write_eof():
        upstream.write_eof()


async def _start(source: Source) -> bytes:
    """The first bytes, as many as it takes to see a request method and its space (fewer if
    the client stops sending: a protocol that waits for the server must not hang here)."""
    data = await source.fill(1)
    while len(data) < 13 and data.isalpha() and data.isupper() and not source.eof:
        more = await source.fill(len(data) + 1)
        if len(more) == len(data):
            break
        data = more
    return data


def _looks_like_http(start: bytes) -> bool:
    return _METHOD.match(start) is not None


async def _http_requests(
    host: str, port: int, source: Source, upstream: asyncio.StreamWriter, chunk: int
) -> None:
    while True:  # one HTTP/1.x request after another (keep-alive is fine in a tunnel)
        try:
            head = await source.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise Mismatch("an incomplete HTTP request in the tunnel") from None
            if upstream.can_write_eof():
                upstream.write_eof()
            return
        request = parse_request(head)
        if isinstance(request, str):
            raise Mismatch(f"not HTTP/1.x where HTTP/1.x began: {request}")
        method, target, headers = request
        framing = body_framing(headers)
        if isinstance(framing, str):
            raise Mismatch(framing)
        if not target.startswith("/") and target != "*":  # absolute-form: its own host
            target = "/" + target.split("://", 1)[-1].partition("/")[2]
        version = head.split(b"\r\n", 1)[0].rsplit(b" ", 1)[1].decode("latin-1")
        lines = [f"{method} {target} {version}", f"Host: {authority(host, port)}"]
        out = [line.encode("latin-1") for line in lines]
        out += [
            n + b": " + v
            for n, v in headers
            if n.lower() != b"host" and n.lower() not in HOST_OVERRIDES
        ]
        upstream.write(b"\r\n".join(out) + b"\r\n\r\n")
        await copy_body(framing, source, upstream, chunk)


def _name(sni: str) -> str:
    try:
        return normalize_host(sni)
    except ValueError:
        return sni
