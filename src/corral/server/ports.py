"""Ports out of the box: ``/v1/boxes/{id}/ports`` exposes a port a box listens on after it
started (:meth:`corral.Sandbox.expose`: a host ``127.0.0.1`` port), and
``/v1/boxes/{id}/ports/{port}/{path}`` is its preview URL: HTTP requests (any method, bodies
streamed both ways) and WebSocket upgrades proxied to the box's port, behind the server's own
auth (a token, or the unix socket's owner).

The proxy is a client of the exposed host port (httpx for HTTP, websockets for WebSocket), so
the box is reached the one way every publish uses, and the box never sees the caller's
credentials: the ``Authorization`` header, cookies and the WebSocket's ``token`` query
parameter stay here, and the proxy keeps no cookie of its own (:class:`_NoCookies`). Pages
of the box are served sandboxed (:data:`SANDBOXED`): a browser gives them an opaque origin,
so they are not the server's own pages to the Origin check. A port nothing listens on
answers 502 ``port_not_reachable`` at once (the guest agent closes the data connection when
its connect fails), a paused box 409 ``sandbox_paused``: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpx
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask
from starlette.types import Send

from corral import errors
from corral.policy import PublishedPort
from corral.server.auth import deny_websocket
from corral.server.boxes import Boxes

__all__ = ["add_port_routes"]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers about one connection (RFC 9110 7.6.1), never forwarded."""
PRIVATE = frozenset({"authorization", "cookie", "host"})
"""The caller's credentials for corral, and the Host the server checked: not the box's."""
OWN_ANSWER = frozenset({"date", "server"})
"""The server sends its own of these on every answer (uvicorn): the box's would be a second,
which HTTP does not allow for Date. A reverse proxy answers with its own, as nginx does."""
SANDBOXED = (
    b"content-security-policy",
    b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads",
)
"""On every proxied answer: a browser runs the box's page in an opaque origin, not the
server's own, so the page's scripts cannot call the API as its pages would (a hostile box
must not drive the server that holds it through a person's browser)."""
CONNECT_TIMEOUT = 10.0
WS_OPEN_TIMEOUT = 10.0


class ExposeIn(BaseModel):
    port: int = Field(gt=0, lt=65536, description="the box port a server listens on")
    host_port: int = Field(
        0, ge=0, lt=65536, description="host 127.0.0.1 port to use; 0: any free one"
    )


class PortOut(BaseModel):
    port: int = Field(description="the box port")
    host_ip: str
    host_port: int
    url: str = Field(description="the box's server from this host, without the corral server")
    preview_path: str = Field(description="the same through corral serve, behind its auth")


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """A jar that stores no cookie and sends none: the proxy is not a browser. A client's
    jar is shared by every proxied request, so a cookie one box's server set would be sent
    to every later request, to any box, whoever asked; the caller's browser keeps the box's
    cookies (the ``Set-Cookie`` is passed back to it), the proxy keeps nothing."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


def _port_out(box_id: str, published: PublishedPort) -> PortOut:
    host = published.host_ip if ":" not in published.host_ip else f"[{published.host_ip}]"
    return PortOut(
        port=published.box_port,
        host_ip=published.host_ip,
        host_port=published.port_on_host,
        url=f"http://{host}:{published.port_on_host}/",
        preview_path=f"/v1/boxes/{box_id}/ports/{published.box_port}/",
    )


class _Relayed(StreamingResponse):
    """A box's answer relayed as it comes. One the box cut (its server died, the box was
    closed) is cut here too: the connection closes without the final chunk or the rest of
    the declared length, so the caller sees a broken answer, as it would from the box's
    port itself, never one ended as if whole (uvicorn logs that the answer was not
    completed)."""

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError:
            return  # no last message: the connection closes mid-answer
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _forwarded(
    headers: list[tuple[bytes, bytes]], drop_also: frozenset[str] = frozenset()
) -> list[tuple[bytes, bytes]]:
    drop = set(HOP_BY_HOP | PRIVATE | drop_also)
    for name, value in headers:  # and what Connection names as hop-by-hop
        if name.lower() == b"connection":
            drop |= {v.strip().lower() for v in value.decode("latin-1").split(",")}
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in drop]


def _check_port(port: int) -> None:
    """A port in a URL path is the caller's input, refused as ``POST .../ports`` refuses
    one in its body (``invalid_input``), not as a policy's."""
    if not 0 < port < 65536:
        raise errors.SandboxError(
            f"not a TCP port: {port} (a box port is 1-65535)", code=errors.ErrorCode.INVALID_INPUT
        )


def _unreachable(port: int, exc: BaseException) -> errors.PortNotReachable:
    why = str(exc) or type(exc).__name__
    return errors.PortNotReachable(
        f"nothing answered on box port {port} ({why}); is a server listening on "
        f"127.0.0.1:{port} (or [::1]) inside the box? 0.0.0.0 works too"
    )


def add_port_routes(app: FastAPI, boxes: Boxes) -> None:  # noqa: C901
    """The routes above, on ``app``; one httpx client for every proxied request (it lives
    as long as the process serving)."""
    client: httpx.AsyncClient | None = None

    def http_client() -> httpx.AsyncClient:
        nonlocal client
        if client is None:
            client = httpx.AsyncClient(
                trust_env=False,  # never a proxy from the environment
                cookies=http.cookiejar.CookieJar(policy=_NoCookies()),
                follow_redirects=False,
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            )
        return client

    async def exposed(box_id: str, port: int) -> PublishedPort:
        """The box port's host port, exposing it now if the box did not yet."""
        _check_port(port)
        sb = boxes.get(box_id).sandbox
        if sb.paused:  # its server is frozen: a request would wait as long as the pause
            raise errors.SandboxPaused(
                f"box {box_id} is paused, so its server on port {port} cannot answer: "
                f"resume it first (POST /v1/boxes/{box_id}/resume)"
            )
        for published in sb.published:
            if published.box_port == port:
                return published
        return await sb.expose(port)

    @app.post("/v1/boxes/{box_id}/ports", tags=["ports"], status_code=201)
    async def expose(box_id: str, body: ExposeIn) -> PortOut:
        published = await boxes.get(box_id).sandbox.expose(body.port, host_port=body.host_port)
        return _port_out(box_id, published)

    @app.get("/v1/boxes/{box_id}/ports", tags=["ports"])
    async def list_ports(box_id: str) -> list[PortOut]:
        return [_port_out(box_id, p) for p in boxes.get(box_id, touch=False).sandbox.published]

    @app.delete("/v1/boxes/{box_id}/ports/{port}", tags=["ports"], status_code=204)
    async def unexpose(box_id: str, port: int) -> Response:
        _check_port(port)
        await boxes.get(box_id).sandbox.unexpose(port)
        return Response(status_code=204)

    preview = "/v1/boxes/{box_id}/ports/{port}/{path:path}"
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    async def proxy_http(request: Request, box_id: str, port: int, path: str) -> Response:
        """The box's server at ``/{path}``: the request as sent, less hop-by-hop headers and
        the caller's corral credentials; the answer streamed back as the box sent it."""
        published = await exposed(box_id, port)
        target = httpx.URL(
            scheme="http",
            host=published.host_ip,
            port=published.port_on_host,
            path="/" + path,
            query=request.url.query.encode("latin-1"),
        )
        has_body = request.method not in ("GET", "HEAD", "OPTIONS") or (
            "content-length" in request.headers or "transfer-encoding" in request.headers
        )
        upstream = http_client().build_request(
            request.method,
            target,
            headers=_forwarded(request.headers.raw),
            content=request.stream() if has_body else None,
        )
        try:
            answer = await http_client().send(upstream, stream=True)
        except httpx.TransportError as exc:
            boxes.get(box_id, touch=False)  # closed meanwhile: box_not_found, not a server hint
            raise _unreachable(port, exc) from None
        boxes.get(box_id)  # a long download keeps the box from its idle timeout: touch it
        response = _Relayed(
            answer.aiter_raw(),
            status_code=answer.status_code,
            background=BackgroundTask(answer.aclose),
        )
        response.raw_headers = [*_forwarded(answer.headers.raw, OWN_ANSWER), SANDBOXED]
        return response

    for method in methods:  # one operation per method: OpenAPI ids must be unique
        app.add_api_route(
            preview,
            proxy_http,
            methods=[method],
            tags=["ports"],
            response_model=None,
            operation_id=f"preview_{method.lower()}",
            include_in_schema=method in ("GET", "POST"),
        )

    @app.websocket(preview)
    async def proxy_ws(websocket: WebSocket, box_id: str, port: int, path: str) -> None:
        """A WebSocket to the box's server at ``/{path}``: messages relayed both ways as they
        are (text stays text), closes passed on."""
        import websockets
        from websockets.asyncio.client import connect

        try:
            published = await exposed(box_id, port)
        except errors.SandboxError as exc:
            await deny_websocket(websocket, exc)
            return
        query = [(k, v) for k, v in parse_qsl(websocket.url.query, True) if k != "token"]
        uri = f"ws://{published.host_ip}:{published.port_on_host}/{path}"
        if query:
            uri += "?" + urlencode(query)
        protocols = [
            p.strip()
            for p in websocket.headers.get("sec-websocket-protocol", "").split(",")
            if p.strip()
        ]
        try:
            upstream = await connect(
                uri,
                subprotocols=protocols or None,  # type: ignore[arg-type]
                open_timeout=WS_OPEN_TIMEOUT,
                max_size=None,
                proxy=None,
                compression=None,
            )
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            # The box's end is connected before the caller's handshake is answered, so a
            # port nothing listens on refuses the handshake itself (502 and the JSON body, as
            # over HTTP): a browser's WebSocket then never fires `open`.
            await deny_websocket(websocket, _unreachable(port, exc))
            return
        await websocket.accept(subprotocol=upstream.subprotocol)

        async def box_to_caller() -> None:
            async for message in upstream:
                if isinstance(message, str):
                    await websocket.send_text(message)
                else:
                    await websocket.send_bytes(message)

        async def caller_to_box() -> None:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    await upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await upstream.send(message["bytes"])

        tasks = [asyncio.ensure_future(box_to_caller()), asyncio.ensure_future(caller_to_box())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await upstream.close()
            code: Any = upstream.close_code or 1000
            with contextlib.suppress(Exception):  # the caller may be gone already
                await websocket.close(code=code if code != 1006 else 1011)
