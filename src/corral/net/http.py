"""HTTP/1.1 as the egress proxy speaks it: request heads, the request sent upstream, body
framing and the proxy's own answers.

An absolute-form request (``GET http://host:port/path``) is checked against the policy by
the host in its URL. What reaches the upstream server must name that same host, and nothing
after the request may follow it down the connection, so:

- the ``Host`` header is rewritten from the URL (RFC 9112, section 3.2.2: a proxy ignores the
  client's ``Host`` for an absolute-form request); without this, any virtual host served on
  an allowed address was reachable by sending its name in ``Host``;
- headers naming another host to a reverse proxy (``Forwarded``, ``X-Forwarded-Host``,
  ``X-Original-URL``...: :data:`HOST_OVERRIDES`) are dropped;
- hop-by-hop headers (``Connection``, ``Keep-Alive``, ``Upgrade``, ``TE``, ``Trailer``, every
  ``Proxy-*`` and whatever ``Connection`` lists) are dropped and ``Connection: close`` sent;
- exactly one request body is forwarded, framed by ``Content-Length`` or chunked encoding; a
  request with both, or with another transfer coding, is refused (the classic smuggling
  shapes), and whatever the client sends after the body is never forwarded.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

DROPPED = frozenset(
    {b"connection", b"keep-alive", b"te", b"trailer", b"upgrade", b"host", b"http2-settings"}
)
"""Headers never forwarded: hop-by-hop ones, and ``Host`` (written from the URL instead)."""
HOST_OVERRIDES = frozenset(
    {
        b"forwarded",
        b"x-forwarded-host",
        b"x-forwarded-server",
        b"x-host",
        b"x-original-host",
        b"x-http-host-override",
        b"x-original-url",
        b"x-rewrite-url",
    }
)
"""Headers that name another host (or path) to a server behind a reverse proxy: frameworks
and load balancers that trust them route by them, so a client's would reach another virtual
host of an allowed address, as a forged ``Host`` did. Only a proxy sets them: dropped."""
MAX_CHUNK_LINE = 4096

HTTP_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    504: "Gateway Timeout",
}
REFUSAL_HEADER = "X-Corral-Refusal"
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


def reason_phrase(text: str, limit: int = 300) -> str:
    """``text`` made safe for a status line or header value: one line of printable ASCII."""
    flat = _UNPRINTABLE.sub(" ", text).strip()
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def http_response(status: int, message: str, summary: str | None = None) -> bytes:
    """The proxy's own answer. ``summary`` (one line) goes in the status line's reason
    phrase and the :data:`REFUSAL_HEADER`, where clients that never show a body do show it
    (``pip``: "Tunnel connection failed: 403 <reason>"); ``message`` is the body."""
    body = (message.rstrip("\n") + "\n").encode()
    reason = reason_phrase(summary) if summary else HTTP_REASONS.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "X-Corral-Proxy: refused\r\n"
    )
    if summary:
        head += f"{REFUSAL_HEADER}: {reason}\r\n"
    return (head + "\r\n").encode() + body


def parse_request(head: bytes) -> tuple[str, str, list[tuple[bytes, bytes]]] | str:
    """(method, target, headers) of a request head, or what is wrong with it."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[0].isalpha():
        shown = lines[0][:80].decode("latin-1")
        return (
            f"malformed request line {shown!r}: this is an HTTP proxy "
            "(use CONNECT host:port, an absolute http:// URL, or SOCKS5)"
        )
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b" " in name:
            return f"malformed header line {line[:80].decode('latin-1')!r}"
        headers.append((name, value.strip()))
    return parts[0].decode(), parts[1].decode("latin-1"), headers


@dataclass(frozen=True, slots=True)
class Framing:
    """How long the request body is: ``length`` bytes, or chunked (``length`` is None)."""

    length: int | None


NO_BODY = Framing(0)


def body_framing(headers: list[tuple[bytes, bytes]]) -> Framing | str:
    """The request body's framing, or why the request is refused (ambiguous framing)."""
    lengths = {v for n, v in headers if n.lower() == b"content-length"}
    codings = [v.strip().lower() for n, v in headers if n.lower() == b"transfer-encoding"]
    if codings:
        if lengths:
            return "both Content-Length and Transfer-Encoding: the request body is ambiguous"
        if codings != [b"chunked"]:
            shown = b", ".join(codings).decode("latin-1")
            return f"unsupported Transfer-Encoding {shown!r} (only 'chunked')"
        return Framing(None)
    if not lengths:
        return NO_BODY
    if len(lengths) > 1:
        return "conflicting Content-Length headers"
    (text,) = lengths
    if not text.isdigit():
        return f"bad Content-Length {text[:40].decode('latin-1')!r}"
    return Framing(int(text))


@dataclass(frozen=True, slots=True)
class OriginRequest:
    host: str
    port: int
    head: bytes
    """The request head to send upstream (origin-form target, Host from the URL)."""
    framing: Framing


def origin_request(
    method: str, target: str, headers: list[tuple[bytes, bytes]]
) -> OriginRequest | str:
    """What to send upstream for an absolute-form ``http://`` request, or an error."""
    try:
        url = urlsplit(target)
        port = url.port or 80
    except ValueError as exc:
        return f"bad request target {target[:200]!r}: {exc}"
    if url.scheme == "https":
        return "https:// URLs go through the proxy with CONNECT (set HTTPS_PROXY)"
    if url.scheme != "http" or not url.hostname:
        return (
            f"request target {target[:200]!r} is not an absolute http:// URL: this is an "
            "HTTP proxy (use CONNECT host:port, an absolute http:// URL, or SOCKS5)"
        )
    framing = body_framing(headers)
    if isinstance(framing, str):
        return framing
    listed = {
        token.strip().lower()
        for n, v in headers
        if n.lower() == b"connection"
        for token in v.split(b",")
    }
    # The host as the URL names it (the name the policy checked), never the client's Host.
    authority = url.netloc.rpartition("@")[2]
    out = [f"{method} {(url.path or '/') + (f'?{url.query}' if url.query else '')} HTTP/1.1"]
    out.append(f"Host: {authority}")
    lines = [line.encode("latin-1") for line in out]
    for name, value in headers:
        lower = name.lower()
        if lower in DROPPED or lower in HOST_OVERRIDES or lower in listed:
            continue
        if lower.startswith(b"proxy-"):
            continue
        lines.append(name + b": " + value)
    lines.append(b"Connection: close")
    return OriginRequest(url.hostname, port, b"\r\n".join(lines) + b"\r\n\r\n", framing)


class Readable(Protocol):
    """What :func:`copy_body` reads from: an asyncio.StreamReader, or a look-ahead view."""

    async def read(self, n: int = ..., /) -> bytes: ...
    async def readexactly(self, n: int, /) -> bytes: ...
    async def readuntil(self, separator: bytes = ..., /) -> bytes: ...


async def _copy_exactly(n: int, src: Readable, dst: asyncio.StreamWriter, chunk: int) -> None:
    """Copy exactly ``n`` bytes (a body, or one chunk's data) in pieces of ``chunk``."""
    left = n
    while left:
        data = await src.read(min(left, chunk))
        if not data:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(data)
        dst.write(data)
        await dst.drain()


async def copy_body(framing: Framing, src: Readable, dst: asyncio.StreamWriter, chunk: int) -> None:
    """Copy exactly one request body from ``src`` to ``dst`` (ValueError if malformed)."""
    if framing.length is not None:
        await _copy_exactly(framing.length, src, dst, chunk)
        return
    while True:  # chunked: size line, data, CRLF ... a zero size, trailers, an empty line
        line = await _line(src)
        size_text = line.split(b";", 1)[0].strip()
        if not _HEX.fullmatch(size_text):
            raise ValueError(f"bad chunk size line {line[:40]!r}")
        size = int(size_text, 16)
        dst.write(line)
        if size == 0:
            while (trailer := await _line(src)) != b"\r\n":
                dst.write(trailer)
            dst.write(b"\r\n")
            await dst.drain()
            return
        await _copy_exactly(size, src, dst, chunk)
        if await src.readexactly(2) != b"\r\n":
            raise ValueError("chunk data not followed by CRLF")
        dst.write(b"\r\n")


async def _line(src: Readable) -> bytes:
    line = await src.readuntil(b"\n")
    if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\r\n"):
        raise ValueError("bad line in a chunked body")
    return line
