"""Who may call ``corral serve``, checked in front of the API (plain ASGI middleware).

- **Tokens with scopes.** ``Authorization: Bearer TOKEN``; a token is ``read`` (observers:
  GET requests and ``/metrics``) or ``operate`` (everything). Compared in constant time.
  Browsers cannot set headers on a WebSocket, so a WebSocket may carry its token as the
  ``token`` query parameter instead.
- **A unix socket** serves its owner only: the connection is refused at accept by peer uid
  (``SO_PEERCRED``, in :mod:`corral.server.transport`), and the owner needs no token.
- **DNS rebinding.** Over TCP the ``Host`` header must name the address the server listens
  on with its port (or ``localhost``/``127.0.0.1``/``[::1]`` when that is loopback; any IP
  address when it is every address, ``0.0.0.0`` or ``::``), or a name given with
  ``--allow-host``, with any port or none (a TLS proxy in front sends its own, or none for
  443): a page on another site that resolves its own name to 127.0.0.1 is refused. (An IP
  address in ``Host`` is safe to take: a rebinding page's Host is its own name.)
- **Cross-origin requests.** A request with an ``Origin`` header is served only when that
  origin is the server's own: ``http://`` or ``https://`` (a TLS proxy's page) + the Host it
  was sent to, or a ``--allow-host`` name that Host names too.
- **Oversize bodies.** A body over ``max_json_bytes`` is refused with 413 (at once when its
  ``Content-Length`` says so, else while it arrives), whatever its ``Content-Type`` says:
  only the routes that stream a body through (file contents, a process's or a command's
  stdin, ``/v1/cli/run``, preview URLs) take more.

Every refusal is a JSON error with a stable code (``unauthorized``, ``request_too_large``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import errors

__all__ = [
    "Access",
    "Guard",
    "TokenScope",
    "deny_websocket",
    "error_body",
    "reads_whole",
    "status_for",
]

TokenScope = Literal["read", "operate"]
OPEN_PATHS = frozenset({"/v1/health", "/"})
"""Served without a token: they hold no data (``/`` is the dashboard's page)."""
OPEN_PREFIX = "/static/"
"""The dashboard's scripts and styles."""
MAX_JSON_BYTES = 1 << 20
BODY_TIMEOUT = 10.0
_PREVIEW = re.compile(r"^/v1/boxes/[^/]+/ports/[^/]+/")
"""A preview URL (:mod:`corral.server.ports`): requests proxied to a box's server."""
_STREAMED = re.compile(
    r"^/v1/boxes/[^/]+/(files/content|processes/[^/]+/stdin|exec)$|^/v1/cli/run$"
)
"""Routes whose body is streamed through to a box (not read whole): not capped here."""

_STATUS: Mapping[errors.ErrorCode, int] = {
    errors.ErrorCode.INVALID_POLICY: 400,
    errors.ErrorCode.INVALID_INPUT: 400,
    errors.ErrorCode.REQUEST_TOO_LARGE: 413,
    errors.ErrorCode.FILE_TOO_LARGE: 413,
    errors.ErrorCode.UNAUTHORIZED: 401,
    errors.ErrorCode.ACCESS_DENIED: 403,
    errors.ErrorCode.PERMISSION_DENIED: 403,
    errors.ErrorCode.PATH_OUTSIDE_SANDBOX: 403,
    errors.ErrorCode.BOX_NOT_FOUND: 404,
    errors.ErrorCode.PROCESS_NOT_FOUND: 404,
    errors.ErrorCode.SESSION_NOT_FOUND: 404,
    errors.ErrorCode.FILE_NOT_FOUND: 404,
    errors.ErrorCode.IMAGE_NOT_FOUND: 404,
    errors.ErrorCode.COMMAND_NOT_FOUND: 422,
    errors.ErrorCode.NOT_EXECUTABLE: 422,
    errors.ErrorCode.SPAWN_FAILED: 422,  # a cwd that is not there: the request's, not ours
    errors.ErrorCode.IS_A_DIRECTORY: 409,
    errors.ErrorCode.NOT_A_DIRECTORY: 409,
    errors.ErrorCode.NOT_A_REGULAR_FILE: 409,
    errors.ErrorCode.SESSION_BUSY: 409,
    errors.ErrorCode.SANDBOX_CLOSED: 410,
    errors.ErrorCode.SANDBOX_PAUSED: 409,
    errors.ErrorCode.TIMEOUT: 504,
    errors.ErrorCode.SERVER_BUSY: 503,
    errors.ErrorCode.SERVER_UNAVAILABLE: 503,
    errors.ErrorCode.BACKEND_UNAVAILABLE: 503,
    errors.ErrorCode.PORT_NOT_REACHABLE: 502,
}


def reads_whole(path: str) -> bool:
    """Whether a request to ``path`` has its body read whole (capped), not streamed."""
    return not (_PREVIEW.match(path) or _STREAMED.match(path))


def status_for(code: errors.ErrorCode) -> int:
    return _STATUS.get(code, 500)


def error_body(code: errors.ErrorCode | str, message: str) -> dict[str, object]:
    retryable = code in errors.RETRYABLE
    return {"error": {"code": str(code), "message": message, "retryable": retryable}}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped, as the stdlib writes it by default. A
    path or command line holding bytes that are not UTF-8 is a ``str`` with lone surrogates
    (``os.fsdecode``), as the library hands it out; UTF-8, which Starlette and pydantic
    write, cannot carry those (the answer failed), an escape can, and Python's ``json``
    (the remote SDK's, through httpx) reads them back as they were."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Access:
    """The tokens the server takes, and the Host names it answers to."""

    tokens: Mapping[str, TokenScope] = field(default_factory=dict)
    unix_owner: bool = False
    """The server listens on a unix socket only: every connection is its owner's."""
    hosts: frozenset[str] = frozenset()
    """Host header values accepted as they are: the address listened on, with its port
    (all three fields empty: any Host, as on a unix socket)."""
    names: frozenset[str] = frozenset()
    """Host names (lower case) accepted with any port or none: ``--allow-host``. A proxy in
    front sends the name its clients used, with its own port or none for the default one."""
    any_ip_port: int | None = None
    """Listening on every address (``0.0.0.0``, ``::``): a Host that is an IP address with
    this port is one of this machine's addresses (a client cannot know which ones it has)."""
    max_json_bytes: int = MAX_JSON_BYTES
    body_timeout: float = BODY_TIMEOUT
    """Seconds a capped (read-whole) body may take to arrive."""

    @classmethod
    def tcp(
        cls, tokens: Mapping[str, TokenScope], host: str, port: int, allow: Iterable[str] = ()
    ) -> Access:
        """The access of a server listening on ``host:port`` that also answers to the
        ``--allow-host`` names ``allow`` (a port given with one is dropped: any is taken)."""
        names = {f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}
        if host in ("127.0.0.1", "localhost", "::1") or host in WILDCARDS:
            names |= {f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
        return cls(
            tokens=tokens,
            hosts=frozenset(names),
            names=frozenset(_split_host(h)[0] for h in allow),
            any_ip_port=port if host in WILDCARDS else None,
        )

    def answers_to(self, host: str) -> bool:
        """Whether a request whose ``Host`` header is ``host`` is for this server."""
        if not (self.hosts or self.names or self.any_ip_port):
            return True
        if host in self.hosts:
            return True
        name, port = _split_host(host)
        if name in self.names:
            return True
        if self.any_ip_port is None or port != self.any_ip_port:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def same_origin(self, origin: str, host: str) -> bool:
        """Whether a page at ``origin`` is this server's own, as reached at ``host``: served
        from that very Host (plain, or by a TLS proxy), or from an ``--allow-host`` name that
        ``host`` names too (a proxy may add or drop the port on its way)."""
        scheme, sep, authority = origin.partition("://")
        if not sep or scheme.lower() not in ("http", "https"):
            return False
        if authority == host:
            return True
        name = _split_host(authority)[0]
        return name in self.names and name == _split_host(host)[0]

    def scope_of(self, token: str | None) -> TokenScope | None:
        if token is None:
            return None
        for known, scope in self.tokens.items():
            if hmac.compare_digest(token.encode(), known.encode()):
                return scope
        return None


WILDCARDS = frozenset({"0.0.0.0", "::"})
"""Listen addresses that mean every address of this machine."""


def _split_host(host: str) -> tuple[str, int | None]:
    """A ``Host`` value's name (lower case, IPv6 without brackets) and port (None: none)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, sep, port = host.rpartition(":")
        if not sep or ":" in name:  # no port, or a bare IPv6 address
            name, port = host, ""
    if port and not port.isdigit():
        return host, None  # not a port: the whole value is a name no one allowed
    return name, int(port) if port else None


def _needs(scope: Scope) -> TokenScope:
    if scope["type"] == "websocket" or _PREVIEW.match(str(scope.get("path", ""))):
        return "operate"  # a box's own server may act on a GET: not an observer's to call
    return "read" if scope.get("method") in ("GET", "HEAD") else "operate"


class Guard:
    """The checks above, in front of ``app``; the caller's scope lands in
    ``scope["state"]["corral_scope"]``."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, code, message = refusal
            await _refuse(scope, receive, send, status, code, message)
            return
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and reads_whole(path):
            # Every other route reads its body whole (FastAPI parses a body as JSON whatever
            # its Content-Type says): capped, so no request can make the server buffer more.
            # (A preview's body is the box server's business: streamed through, not capped.)
            try:
                async with asyncio.timeout(self.access.body_timeout):
                    replay = (
                        None if self._declared_over(headers) else await self._whole_body(receive)
                    )
            except TimeoutError:  # a client trickling a small body holds a connection
                await _refuse(
                    scope,
                    receive,
                    send,
                    408,
                    errors.ErrorCode.TIMEOUT,
                    f"the request body did not arrive within {self.access.body_timeout:g} s",
                )
                return
            if replay is None:
                limit = self.access.max_json_bytes
                await _refuse(
                    scope,
                    receive,
                    send,
                    413,
                    errors.ErrorCode.REQUEST_TOO_LARGE,
                    f"a request body over {limit} bytes; send file contents and stdin as "
                    "streams (application/octet-stream to .../files/content, "
                    ".../processes/PID/stdin or .../exec?stdin=true), not inside JSON",
                )
                return
            receive = replay
        await self.app(scope, receive, send)

    def _declared_over(self, headers: dict[bytes, bytes]) -> bool:
        declared = headers.get(b"content-length", b"").strip()
        return declared.isdigit() and int(declared) > self.access.max_json_bytes

    async def _whole_body(self, receive: Receive) -> Receive | None:
        """Read a body whole (it is small, or refused: None), then hand it on."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.access.max_json_bytes:
                return None
            if not message.get("more_body"):
                break
        first: Message | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        return replay

    def _refusal(
        self, scope: Scope, headers: dict[bytes, bytes]
    ) -> tuple[int, errors.ErrorCode, str] | None:
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.access.answers_to(host):
            return (
                421,
                errors.ErrorCode.UNAUTHORIZED,
                f"this server does not answer to Host {host!r} (DNS rebinding guard); "
                "use the address it listens on, or start it with --allow-host NAME",
            )
        origin = headers.get(b"origin")
        if origin is not None and not self.access.same_origin(origin.decode("latin-1"), host):
            return (
                403,
                errors.ErrorCode.UNAUTHORIZED,
                "cross-origin requests are refused: only pages served by this server may call it",
            )
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in OPEN_PATHS or path.startswith(OPEN_PREFIX)):
            return None
        given = self._token(scope, headers)
        granted: TokenScope | None = "operate" if self.access.unix_owner else None
        if granted is None:
            granted = self.access.scope_of(given)
        if granted is None:
            what = "a wrong bearer token" if given else "no bearer token"
            return (
                401,
                errors.ErrorCode.UNAUTHORIZED,
                f"{what}: send Authorization: Bearer TOKEN (corral serve printed where its "
                "token file is)",
            )
        needed = _needs(scope)
        if needed == "operate" and granted != "operate":
            return (
                403,
                errors.ErrorCode.ACCESS_DENIED,
                "this token is read-only: it may look (GET), not change or run anything",
            )
        scope.setdefault("state", {})["corral_scope"] = granted
        return None

    @staticmethod
    def _token(scope: Scope, headers: dict[bytes, bytes]) -> str | None:
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.lower().startswith("bearer "):
            return given[7:].strip()
        if scope["type"] == "websocket":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            values = query.get("token")
            if values:
                return str(values[0])
        return None


async def _refuse(
    scope: Scope, receive: Receive, send: Send, status: int, code: errors.ErrorCode, message: str
) -> None:
    body = json.dumps(error_body(code, message)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        head.append((b"www-authenticate", b"Bearer"))
    prefix = "http"
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        if "websocket.http.response" not in (scope.get("extensions") or {}):
            await send({"type": "websocket.close", "code": 4000 + min(status, 999), "reason": code})
            return
        prefix = "websocket.http"  # the handshake's answer is this status and JSON body
    await send({"type": f"{prefix}.response.start", "status": status, "headers": head})
    await send({"type": f"{prefix}.response.body", "body": body})


async def deny_websocket(websocket: Any, exc: errors.SandboxError) -> None:
    """Refuse a WebSocket handshake with ``exc``'s status and JSON error body (a close code
    where the server cannot answer a handshake with a response)."""
    status = status_for(exc.code)
    if "websocket.http.response" in (websocket.scope.get("extensions") or {}):
        await websocket.send_denial_response(
            AsciiJSONResponse(error_body(exc.code, exc.message), status_code=status)
        )
        return
    await websocket.close(code=4000 + min(status, 999), reason=str(exc.code))
