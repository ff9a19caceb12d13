"""The web dashboard of ``corral serve`` (``GET /``) and the live audit stream it shows.

The page and its files (``static/``, with xterm.js unpacked into ``static/vendor`` by
``make vendor``) load without a token: they hold no data. The page reads its token from the
URL fragment that ``corral serve`` prints (``#token=...``: never sent to the server, so never
in a log) and sends it on every request. Its Content-Security-Policy admits scripts and
connections from this server only, and no inline script; inline *styles* are admitted because
xterm.js sizes its rows with a ``<style>`` element it writes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from corral import errors
from corral.server.approvals import Approvals
from corral.server.feed import AuditFeed

__all__ = ["CSP", "STATIC", "add_dashboard"]

STATIC = Path(__file__).parent / "static"
KEEPALIVE_SECS = 15.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; font-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def _files() -> dict[str, Path]:
    """The files the dashboard serves, by URL path, found once: nothing else is reachable."""
    found = {"/": STATIC / "index.html"}
    for path in STATIC.rglob("*"):
        if path.is_file() and path.suffix in _TYPES and path.name != "index.html":
            found["/static/" + path.relative_to(STATIC).as_posix()] = path
    return found


class ApprovalAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool: str
    command_line: str | None = None
    reason: str = ""
    box: str | None = Field(None, description="the server's box the call is for, if any")
    timeout_secs: float = Field(300.0, gt=0, le=3600, description="then: denied")


class ApprovalAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    approve: bool


def add_approvals(app: FastAPI, approvals: Approvals) -> None:
    @app.post("/v1/approvals", tags=["approvals"])
    async def ask_approval(body: ApprovalAsk, request: Request) -> dict[str, Any]:
        """Ask a person (on the dashboard) about a tool call; answers when they decide, or
        denied at ``timeout_secs``. A request whose asker disconnects is withdrawn at once
        (no longer listed; answering it is refused)."""
        approval_id, approved, by = await approvals.ask(
            body.tool,
            body.command_line,
            body.reason,
            body.box,
            body.timeout_secs,
            asker_gone=_disconnect(request),
        )
        return {"id": approval_id, "approved": approved, "decided_by": by}

    @app.get("/v1/approvals", tags=["approvals"])
    async def pending_approvals() -> list[dict[str, Any]]:
        return approvals.pending()

    @app.post("/v1/approvals/{approval_id}", tags=["approvals"])
    async def answer_approval(approval_id: str, body: ApprovalAnswer) -> dict[str, bool]:
        approvals.decide(approval_id, body.approve)
        return {"approved": body.approve}


def add_dashboard(app: FastAPI, feed: AuditFeed, approvals: Approvals) -> None:
    files = _files()
    add_approvals(app, approvals)

    def serve_file(url_path: str) -> Response:
        path = files.get(url_path)
        if path is None:
            hint = " (the terminal's xterm.js: run `make vendor`)" if "/vendor/" in url_path else ""
            raise errors.SandboxError(
                f"the dashboard has no file {url_path}{hint}", code=errors.ErrorCode.FILE_NOT_FOUND
            )
        return Response(path.read_bytes(), media_type=_TYPES[path.suffix], headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return serve_file("/")

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        return serve_file("/static/" + name)

    @app.get(
        "/v1/audit",
        tags=["server"],
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def audit(history: bool = True, box: str | None = None) -> StreamingResponse:
        """The audit records of the server's boxes, live, as server-sent events (one JSON
        record per ``data:`` line, with the server's ``box`` id): the last 500 first unless
        ``history=false``; ``box`` keeps one box's."""

        # Subscribed before the response starts: a client that saw the headers misses
        # nothing that happens after (the body starts only once the headers are sent).
        kept, queue = feed.open_reader()

        async def gen() -> AsyncIterator[bytes]:
            try:
                yield b": corral audit stream\n\n"
                for record in kept if history else ():
                    if box is None or record.get("box") == box:
                        yield _event(record)
                while True:
                    try:
                        async with asyncio.timeout(KEEPALIVE_SECS):
                            record = await queue.get()
                    except TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                    if box is None or record.get("box") == box:
                        yield _event(record)
            finally:
                feed.close_reader(queue)

        return StreamingResponse(
            gen(),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )


async def _disconnect(request: Request) -> None:
    """Return when the client of ``request`` (its body read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(record: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(record, default=str).encode() + b"\n\n"
