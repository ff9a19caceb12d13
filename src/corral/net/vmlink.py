"""The host end of a microVM's network link: one stream, many forwarded connections.

A VM has no NIC (and 9p cannot share unix sockets), so its guest agent carries every
connection accepted on a forwarder's loopback port over a second virtio-serial port
(``corral-net``); qemu hands that port to the host as a stream socket, and :class:`VmLink`
connects each connection to the same unix socket the other backends bind into their boxes
(the egress proxy, a port relay: :meth:`corral.net.BoxNetwork.unix_forwarders`). The policy
is applied there, unchanged; this module only moves bytes. Frames and their rules:
:mod:`corral.agent.vmlink`.

The guest is hostile. A frame that breaks the protocol (unknown type, oversized, an OPEN of
an unknown forwarder or of a connection already open, DATA beyond the window the host
granted) drops the whole link, with the reason in the log and the audit log; the host never
raises because of a frame. At most :data:`MAX_CONNS` connections are open at once (more are
refused with CLOSE and audited), and each holds at most its window of the guest's bytes
(``WINDOW_SIZE``) plus the upstream socket's write buffer: the guest cannot make the host
buffer without bound, and one slow connection never stalls the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.agent.vmlink import (
    CLOSE,
    DATA,
    EOF,
    MAX_CONNS,
    MAX_DATA,
    OPEN,
    READ_CHUNK,
    WINDOW,
    WINDOW_SIZE,
    FrameDecoder,
    LinkError,
    encode,
    encode_u32,
    u32,
)
from corral.audit import AuditLog

if TYPE_CHECKING:
    from corral.net.box import BoxNetwork

log = logging.getLogger(__name__)

GUEST_DEVICE = "/dev/corral-net"
"""Where the guest's boot script links the ``corral-net`` port."""
CONNECT_TIMEOUT = 10.0
"""Connecting to a host unix socket (the proxy, a relay) of the same process: instant."""


def guest_config(net: BoxNetwork, device: str = GUEST_DEVICE) -> dict[str, Any]:
    """The agent config's ``"vmlink"`` entry: the device, the ports to listen on (in the
    order :class:`VmLink` gets them) and the files commands expect (the node preload)."""
    return {
        "device": device,
        "forwarders": [{"port": port} for port, _ in net.unix_forwarders()],
        "files": net.guest_files(),
    }


class _Conn:
    """One forwarded connection, host side."""

    __slots__ = (
        "budget",
        "cid",
        "credit",
        "credit_changed",
        "delivered",
        "inbox",
        "inbox_changed",
        "port",
        "remote_eof",
        "sent_eof",
        "task",
    )

    def __init__(self, cid: int, port: int, window: int) -> None:
        self.cid = cid
        self.port = port
        self.credit = window  # bytes the guest still accepts from us
        self.credit_changed = asyncio.Event()
        self.budget = window  # bytes the guest may still send us
        self.delivered = 0  # bytes written upstream and not yet granted back
        self.inbox: deque[bytes] = deque()
        self.inbox_changed = asyncio.Event()
        self.remote_eof = False
        self.sent_eof = False
        self.task: asyncio.Task[None] | None = None


class VmLink:
    """Serves one VM's link until the guest closes it, breaks the protocol, or :meth:`close`.

    ``forwarders``: ``(guest port, host unix socket)`` per forwarder; an OPEN names one by
    its index."""

    def __init__(
        self,
        forwarders: Sequence[tuple[int, Path]],
        audit: AuditLog | None = None,
        *,
        max_conns: int = MAX_CONNS,
        window: int = WINDOW_SIZE,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.forwarders = list(forwarders)
        self.audit = audit
        self.max_conns = max_conns
        self.window = window
        self.connect_timeout = connect_timeout
        self.reason: str | None = None
        """Why the link ended (None while it runs)."""
        self._conns: dict[int, _Conn] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._task = asyncio.create_task(self._run(reader, writer))

    async def wait_closed(self) -> str:
        """Wait until the link ends; the reason."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)
        return self.reason or "not started"

    async def close(self) -> None:
        """End every connection and the link. Idempotent."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        elif self._task is None and self._writer is not None:
            self._writer.close()

    # ---- the link ------------------------------------------------------------------------
    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        try:
            while True:
                data = await reader.read(READ_CHUNK)
                if not data:
                    self.reason = "the guest closed the link"
                    break
                for kind, cid, payload in decoder.feed(data):
                    self._on_frame(kind, cid, payload)
                await writer.drain()  # a guest that does not read stops being read
        except LinkError as exc:
            self.reason = f"protocol violation: {exc}"
            log.warning("dropping a microVM's network link: %s", exc)
            self._record("error", 0, reason=f"network link dropped: {exc}")
        except OSError as exc:
            self.reason = f"link error: {exc}"
        except asyncio.CancelledError:
            self.reason = "closed by the host"
            raise
        finally:
            self._closing = True
            tasks = [c.task for c in self._conns.values() if c.task is not None]
            self._conns.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    def _send(self, frame: bytes) -> None:
        if not self._closing and self._writer is not None:
            self._writer.write(frame)

    def _on_frame(self, kind: int, cid: int, payload: bytes) -> None:
        conn = self._conns.get(cid)
        if kind == OPEN:
            self._open(cid, u32(payload), conn)
        elif conn is None:
            return  # a connection that ended: its late frames are stale
        elif kind == DATA:
            if conn.remote_eof:
                raise LinkError(f"DATA after EOF on connection {cid}")
            if len(payload) > conn.budget:
                raise LinkError(
                    f"connection {cid} sent {len(payload)} bytes with a window of {conn.budget}"
                )
            conn.budget -= len(payload)
            conn.inbox.append(payload)
            conn.inbox_changed.set()
        elif kind == EOF:
            if conn.remote_eof:
                raise LinkError(f"second EOF on connection {cid}")
            conn.remote_eof = True
            conn.inbox_changed.set()
        elif kind == CLOSE:
            del self._conns[cid]  # the guest forgot it: no CLOSE back
            if conn.task is not None:
                conn.task.cancel()
        elif kind == WINDOW:
            grant = u32(payload)
            if not 0 < grant <= self.window - conn.credit:
                raise LinkError(
                    f"connection {cid} granted {grant} bytes, more than were sent to it"
                )
            conn.credit += grant
            conn.credit_changed.set()

    def _open(self, cid: int, index: int, conn: _Conn | None) -> None:
        if conn is not None:
            raise LinkError(f"OPEN of connection {cid}, which is open")
        if index >= len(self.forwarders):
            raise LinkError(f"OPEN of forwarder {index}; there are {len(self.forwarders)}")
        port = self.forwarders[index][0]
        if len(self._conns) >= self.max_conns:
            self._record(
                "deny", port, reason=f"more than {self.max_conns} connections open at once"
            )
            self._send(encode(CLOSE, cid))
            return
        conn = _Conn(cid, port, self.window)
        self._conns[cid] = conn
        conn.task = asyncio.create_task(self._serve(conn, self.forwarders[index][1]))

    # ---- one connection ------------------------------------------------------------------
    async def _serve(self, conn: _Conn, path: Path) -> None:
        clean = False
        upstream: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, upstream = await asyncio.open_unix_connection(str(path), limit=MAX_DATA)
            except (OSError, TimeoutError) as exc:
                self._record("error", conn.port, reason=f"{path}: {exc}")
                return
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._to_guest(conn, reader))
                    group.create_task(self._from_guest(conn, upstream))
                clean = True
            except* OSError:
                pass
        finally:
            if upstream is not None:
                upstream.close()
            if self._conns.get(conn.cid) is conn:
                del self._conns[conn.cid]
                if not clean:
                    self._send(encode(CLOSE, conn.cid))

    async def _to_guest(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        """Upstream -> guest, within the window the guest granted."""
        while True:
            while conn.credit <= 0:
                conn.credit_changed.clear()
                await conn.credit_changed.wait()
            data = await reader.read(min(conn.credit, MAX_DATA))
            if not data:
                conn.sent_eof = True
                self._send(encode(EOF, conn.cid))
                return
            conn.credit -= len(data)
            self._send(encode(DATA, conn.cid, data))
            if self._writer is not None:
                await self._writer.drain()

    async def _from_guest(self, conn: _Conn, writer: asyncio.StreamWriter) -> None:
        """Guest -> upstream; what was delivered is granted back to the guest.

        Once upstream has closed after its answer (EOF sent to the guest), what the guest
        still sends is dropped rather than the connection reset: a CLOSE now could discard
        the answer before the guest delivered it."""
        discard = False
        while True:
            while not conn.inbox and not conn.remote_eof:
                conn.inbox_changed.clear()
                await conn.inbox_changed.wait()
            if not conn.inbox:
                if not discard and writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            size = sum(len(chunk) for chunk in conn.inbox)
            data = b"".join(conn.inbox)
            conn.inbox.clear()
            if not discard:
                try:
                    writer.write(data)
                    await writer.drain()
                except OSError:
                    if not conn.sent_eof:
                        raise
                    discard = True
            conn.delivered += size
            if conn.delivered >= self.window // 4:  # in batches, as the guest does
                conn.budget += conn.delivered
                self._send(encode_u32(WINDOW, conn.cid, conn.delivered))
                conn.delivered = 0

    def _record(self, action: str, port: int, **extra: object) -> None:
        if self.audit is not None:
            self.audit.record(
                "network", action=action, protocol="vmlink", host="127.0.0.1", port=port, **extra
            )
