"""The network link of a microVM: loopback connections multiplexed over a virtio-serial port.

Stdlib only, imported by both sides: by the host as ``corral.agent.vmlink`` (the frame codec)
and by the guest agent, inside a VM, as a sibling module (:func:`start`). A VM has no NIC and
cannot share unix sockets over 9p, so the guest agent listens on the loopback ports of the
box's forwarders (the egress proxy, the exposed host ports) and carries every accepted
connection over one port device (``corral-net``) to the host, which connects it to the unix
socket the other backends bind into their boxes (:mod:`corral.net.vmlink`).

A frame is a 9-byte header and a payload::

    u8              type: OPEN, DATA, EOF, CLOSE or WINDOW
    u32 big-endian  connection id (chosen by the guest, never reused in one link)
    u32 big-endian  payload length (0 .. MAX_DATA; fixed for every type but DATA)

=======  =======  ============================================================================
type     payload  meaning
=======  =======  ============================================================================
OPEN     u32      guest -> host: a new connection to forwarder number N (its index in the list)
DATA     bytes    stream bytes; never more than the receiver's remaining window
EOF      -        the sender will send no more DATA on this connection (a half-close)
CLOSE    -        the sender dropped the connection (refused, reset, error): forget it
WINDOW   u32      the receiver delivered N more bytes: the sender may send N more
                  (sent once ``GRANT_AT`` bytes were delivered, not for every DATA)
=======  =======  ============================================================================

Each side may have at most :data:`WINDOW_SIZE` bytes in flight per connection, so a slow
reader holds up its own connection only and bounds the memory it costs. A connection both
sides have ended with EOF (and delivered) is forgotten without a frame; frames for an
unknown connection are stale and ignored.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import deque

TYPE_CHECKING = False  # the guest agent does not import typing (see agent.py)
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct(">BII")
U32 = struct.Struct(">I")
OPEN, DATA, EOF, CLOSE, WINDOW = 1, 2, 3, 4, 5
KIND_NAMES = {OPEN: "OPEN", DATA: "DATA", EOF: "EOF", CLOSE: "CLOSE", WINDOW: "WINDOW"}
FIXED_LENGTH = {OPEN: U32.size, EOF: 0, CLOSE: 0, WINDOW: U32.size}
MAX_DATA = 64 * 1024
"""Largest DATA payload: a frame never holds up the others for long."""
WINDOW_SIZE = 256 * 1024
"""Bytes one side may send on one connection before the other grants more."""
GRANT_AT = WINDOW_SIZE // 4
"""Delivered bytes are granted back in batches this big: a short exchange (an HTTP request
and its answer) costs no WINDOW frame at all."""
MAX_CONNS = 256
"""Connections open at once on one link (the guest refuses more, the host too)."""
READ_CHUNK = 256 * 1024


def loopback_listeners(port: int) -> list[socket.socket]:
    """Listening sockets on ``port`` of the box's IPv4 and (where it exists) IPv6 loopback."""
    servers = []
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((address, port))
            server.listen(128)
        except OSError:
            server.close()
            if family == socket.AF_INET:
                raise
            continue  # no IPv6 loopback in this box: IPv4 is enough
        servers.append(server)
    return servers


class LinkError(Exception):
    """A frame that breaks the link protocol: the host drops the link."""


def encode(kind: int, cid: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, cid, len(payload)) + payload


def encode_u32(kind: int, cid: int, value: int) -> bytes:
    """An OPEN (forwarder index) or WINDOW (credit) frame."""
    return HEADER.pack(kind, cid, U32.size) + U32.pack(value)


def u32(payload: bytes) -> int:
    value: int = U32.unpack(payload)[0]
    return value


class FrameDecoder:
    """Incremental, sans-IO frame splitter: feed bytes, get ``(type, id, payload)`` frames.

    Raises :class:`LinkError` for an unknown type, a DATA frame longer than :data:`MAX_DATA`
    or a control frame of the wrong length, before buffering its payload."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[int, int, int] | None = None

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buf += data
        frames: list[tuple[int, int, bytes]] = []
        pos = 0
        buf = self._buf
        while True:
            if self._head is None:
                if len(buf) - pos < HEADER.size:
                    break
                kind, cid, length = HEADER.unpack_from(buf, pos)
                check_header(kind, length)
                self._head = (kind, cid, length)
                pos += HEADER.size
            kind, cid, length = self._head
            if len(buf) - pos < length:
                break
            frames.append((kind, cid, bytes(buf[pos : pos + length])))
            pos += length
            self._head = None
        del buf[:pos]
        return frames


def check_header(kind: int, length: int) -> None:
    if kind == DATA:
        if not 0 < length <= MAX_DATA:
            raise LinkError(f"DATA frame of {length} bytes (1 .. {MAX_DATA} allowed)")
    elif kind in FIXED_LENGTH:
        if length != FIXED_LENGTH[kind]:
            want = FIXED_LENGTH[kind]
            raise LinkError(f"{KIND_NAMES[kind]} frame of {length} bytes (not {want})")
    else:
        raise LinkError(f"unknown frame type {kind}")


# ---- the guest side (threads; started by the agent in a microVM) ---------------------------


def start(config: dict[str, Any]) -> GuestLink:
    """Write the config's files, open the port device and listen on every forwarder's port.

    ``config``: ``{"device": path, "forwarders": [{"port": N}, ...], "files": {path: text}}``.
    The listeners exist when this returns (before the agent's ``ready``)."""
    for path, text in dict(config.get("files") or {}).items():
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "w") as f:
            f.write(str(text))
        os.chmod(path, 0o644)
    fd = os.open(str(config["device"]), os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    link = GuestLink(fd)
    link.listen([int(spec["port"]) for spec in config.get("forwarders") or []])
    link.start()
    return link


class GuestLink:
    """One port device carrying every forwarded connection of the box."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.write_lock = threading.Lock()
        self.lock = threading.Lock()  # conns, next_id, alive
        self.conns: dict[int, GuestConn] = {}
        self.next_id = 1
        self.alive = True
        self.listeners: list[tuple[socket.socket, int]] = []
        self.reader: threading.Thread | None = None

    def listen(self, ports: list[int]) -> None:
        for index, port in enumerate(ports):
            self.listeners += [(server, index) for server in loopback_listeners(port)]

    def start(self) -> None:
        self.reader = threading.Thread(target=self.read_loop, daemon=True)
        self.reader.start()
        for server, index in self.listeners:
            threading.Thread(target=self.accept_loop, args=(server, index), daemon=True).start()

    def close(self) -> None:
        """Stop listening (the agent never does; its VM ends instead)."""
        for server, _ in self.listeners:
            try:
                server.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            server.close()

    # ---- frames out ----------------------------------------------------------------------
    def send(self, frame: bytes) -> None:
        """Write one whole frame (frames of several threads never interleave). Once the link
        is gone nothing is written: a port whose host end closed blocks its writers."""
        if not self.alive:
            return
        view = memoryview(frame)
        with self.write_lock:
            try:
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError:
                self.alive = False
        if not self.alive:
            self.fail()

    # ---- frames in -----------------------------------------------------------------------
    def read_loop(self) -> None:
        decoder = FrameDecoder()
        while True:
            try:
                data = os.read(self.fd, READ_CHUNK)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:  # the host end is gone
                break
            try:
                frames = decoder.feed(data)
            except LinkError:
                break
            for kind, cid, payload in frames:
                conn = self.conns.get(cid)
                if conn is not None:
                    conn.on_frame(kind, payload)
        self.fail()

    def fail(self) -> None:
        """The link is gone: drop every connection; new ones are refused."""
        with self.lock:
            self.alive = False
            conns = list(self.conns.values())
        for conn in conns:
            conn.abort(notify=False)

    # ---- connections ---------------------------------------------------------------------
    def accept_loop(self, server: socket.socket, index: int) -> None:
        while True:
            try:
                sock, _ = server.accept()
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError:
                return
            sock.setblocking(True)
            with self.lock:
                if not self.alive or len(self.conns) >= MAX_CONNS:
                    sock.close()
                    continue
                cid = self.next_id
                self.next_id += 1
                conn = GuestConn(self, cid, sock)
                self.conns[cid] = conn
            self.send(encode_u32(OPEN, cid, index))
            threading.Thread(target=conn.pump_in, daemon=True).start()
            threading.Thread(target=conn.pump_out, daemon=True).start()

    def forget(self, cid: int) -> None:
        with self.lock:
            self.conns.pop(cid, None)


class GuestConn:
    """One accepted loopback connection: two threads, one per direction."""

    def __init__(self, link: GuestLink, cid: int, sock: socket.socket) -> None:
        self.link = link
        self.cid = cid
        self.sock = sock
        self.cond = threading.Condition()
        self.credit = WINDOW_SIZE  # bytes the host still accepts from us
        self.inbox: deque[bytes] = deque()
        self.inbox_bytes = 0
        self.delivered = 0  # not yet granted back
        self.remote_eof = False
        self.aborted = False
        self.pumps = 2

    def on_frame(self, kind: int, payload: bytes) -> None:
        """Called by the link's reader thread: never blocks."""
        if kind == CLOSE:
            self.abort(notify=False)
            return
        overflow = False
        with self.cond:
            if kind == DATA and not self.remote_eof:
                self.inbox_bytes += len(payload)
                self.inbox.append(payload)
                overflow = self.inbox_bytes > WINDOW_SIZE  # the host ignored our window
            elif kind == EOF:
                self.remote_eof = True
            elif kind == WINDOW:
                self.credit += u32(payload)
            self.cond.notify_all()
        if overflow:
            self.abort(notify=True)

    def pump_out(self) -> None:
        """Local socket -> host, within the host's window."""
        try:
            while True:
                with self.cond:
                    while self.credit <= 0 and not self.aborted:
                        self.cond.wait()
                    if self.aborted:
                        return
                    size = min(self.credit, MAX_DATA)
                data = self.sock.recv(size)
                if not data:
                    if not self.aborted:
                        self.link.send(encode(EOF, self.cid))
                    return
                with self.cond:
                    self.credit -= len(data)
                self.link.send(encode(DATA, self.cid, data))
        except OSError:
            self.abort(notify=True)
        finally:
            self.pump_done()

    def pump_in(self) -> None:
        """Host -> local socket; every delivered chunk is granted back as window."""
        try:
            while True:
                with self.cond:
                    while not self.inbox and not self.remote_eof and not self.aborted:
                        self.cond.wait()
                    if self.aborted:
                        return
                    if not self.inbox:
                        self.sock.shutdown(socket.SHUT_WR)
                        return
                    chunk = self.inbox.popleft()
                    self.inbox_bytes -= len(chunk)
                self.sock.sendall(chunk)
                self.delivered += len(chunk)
                if self.delivered >= GRANT_AT:
                    self.link.send(encode_u32(WINDOW, self.cid, self.delivered))
                    self.delivered = 0
        except OSError:
            self.abort(notify=True)
        finally:
            self.pump_done()

    def abort(self, notify: bool) -> None:
        """End the connection now; ``notify``: tell the host (a local error, not its CLOSE)."""
        with self.cond:
            first = not self.aborted
            self.aborted = True
            self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv/sendall
        except OSError:
            pass
        if notify and first:
            self.link.send(encode(CLOSE, self.cid))

    def pump_done(self) -> None:
        with self.cond:
            self.pumps -= 1
            last = self.pumps == 0
        if last:
            self.sock.close()
            self.link.forget(self.cid)
