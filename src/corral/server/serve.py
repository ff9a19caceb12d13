"""Run ``corral serve``: the boxes, the API behind its guard, on uvicorn, until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from corral.server.api import RunParser, build_api
from corral.server.auth import Access, Guard, reads_whole
from corral.server.boxes import Boxes, ServeLimits
from corral.server.metrics import Metrics
from corral.server.transport import http_server_config

__all__ = ["ServeConfig", "build_app", "serve"]

logger = logging.getLogger("corral.server")


@dataclass(frozen=True)
class ServeConfig:
    access: Access
    limits: ServeLimits = field(default_factory=ServeLimits)
    info: dict[str, Any] = field(default_factory=dict)


def build_app(config: ServeConfig, parse_run: RunParser) -> tuple[ASGIApp, Boxes]:
    """The guarded app and the boxes it serves (closing them is the caller's)."""
    metrics = Metrics()
    boxes = Boxes(config.limits, metrics)
    api = build_api(boxes, metrics, info={**config.info, "pid": os.getpid()}, parse_run=parse_run)
    return Guard(api, config.access), boxes


class _Server(uvicorn.Server):
    """uvicorn's server without its re-raise of SIGTERM/SIGINT after shutting down: that
    would kill the process before the boxes are closed (``serve``'s ``finally``); and whose
    shutdown closes the boxes first."""

    def __init__(self, config: uvicorn.Config, boxes: Boxes) -> None:
        super().__init__(config)
        self._boxes = boxes
        self.closing_boxes: asyncio.Future[None] | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """The boxes close as the shutdown begins: the requests in flight on them end with
        ``server_unavailable`` (the JSON error body, retryable; an error frame on a stream)
        while the server still answers. Closed after it, they were cancelled at the end of
        the graceful window and got uvicorn's bare text 500 (a stream just stopped)."""
        self.closing_boxes = asyncio.ensure_future(self._boxes.aclose())
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(config: ServeConfig, parse_run: RunParser, *, sock: socket.socket) -> None:
    """Serve on the bound, listening ``sock`` until SIGINT/SIGTERM (or cancellation); every
    box is closed before this returns. Clients may connect as soon as ``sock`` listens: the
    kernel queues them until the server accepts."""
    app, boxes = build_app(config, parse_run)
    boxes.start_reaper()
    http = http_server_config(app, ws="websockets-sansio", read_whole=reads_whole)
    server = _Server(http, boxes)
    try:
        await server.serve(sockets=[sock])
    finally:
        await (server.closing_boxes or boxes.aclose())
