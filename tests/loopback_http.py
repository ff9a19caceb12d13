"""A tiny HTTP server on the host's 127.0.0.1 for the network tests (never another address)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def echo_path(head: bytes) -> bytes:
    """``hello /path``: the body the in-box clients check."""
    return b"hello " + head.split(b" ")[1] + b"\n"


class LoopbackHttp:
    """Answers every request with ``body(head)``; counts the hits and keeps the heads."""

    def __init__(self, body: Callable[[bytes], bytes] = echo_path) -> None:
        self.body = body
        self.server: asyncio.Server | None = None
        self.port = 0
        self.hits = 0
        self.heads: list[bytes] = []

    async def start(self) -> LoopbackHttp:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.hits += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            body = self.body(head)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
