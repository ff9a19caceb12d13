"""``ports`` mode: chosen host loopback TCP ports, reachable inside the box at the same number.

Why a unix-socket relay and not ``pasta -T``: pasta always also gives the namespace a tap
interface with a default route out (a NAT to everywhere, which ``ports`` must not have), and
``-T`` in pasta's "splice" path needs pasta attached to the box for its whole life. The relay
reuses the proxy's path instead: for each port the host listens on a unix socket in the
box's network directory and connects each accepted stream to ``127.0.0.1:PORT`` on the host;
the guest agent listens on ``127.0.0.1:PORT`` inside and relays to that socket. The box keeps
an empty network namespace (loopback only), so exactly the listed ports are reachable and
nothing else, and the mechanism is the same for every backend that can bind a directory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from corral.audit import AuditLog
from corral.net.proxy import RELAY_CHUNK, UnixService, relay


class PortRelay(UnixService):
    """Host side of one exposed port: unix socket -> host 127.0.0.1:port."""

    def __init__(self, port: int, audit: AuditLog | None = None) -> None:
        super().__init__()
        self.port = port
        self.audit = audit

    async def serve(self, path: Path) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=str(path))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                upstream = await asyncio.open_connection("127.0.0.1", self.port, limit=RELAY_CHUNK)
            except OSError as exc:
                self._record("error", reason=f"host 127.0.0.1:{self.port}: {exc.strerror or exc}")
                return
            self._record("allow")
            await relay(reader, writer, *upstream)
        except OSError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    def _record(self, action: str, **extra: object) -> None:
        if self.audit is not None:
            self.audit.record(
                "network", action=action, protocol="port", host="127.0.0.1", port=self.port, **extra
            )
