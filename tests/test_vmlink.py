"""The microVM's network link: frame codec, the host multiplexer against a fake (hostile)
guest, and the real guest threads against the real host, over a socketpair in this process.

The VM tests (``tests/test_microvm_network.py``) only check the wiring; every rule of the
protocol is checked here, in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.agent import vmlink as guest
from corral.agent.vmlink import (
    CLOSE,
    DATA,
    EOF,
    MAX_DATA,
    OPEN,
    WINDOW,
    WINDOW_SIZE,
    FrameDecoder,
    LinkError,
    encode,
    encode_u32,
    u32,
)
from corral.audit import AuditLog, read_records
from corral.net.vmlink import VmLink

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

# ---- codec ---------------------------------------------------------------------------------

frames = st.lists(
    st.one_of(
        st.tuples(st.just(DATA), st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=300)),
        st.tuples(st.sampled_from([EOF, CLOSE]), st.integers(0, 2**32 - 1), st.just(b"")),
        st.tuples(
            st.sampled_from([OPEN, WINDOW]),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "big")),
        ),
    ),
    max_size=20,
)


@given(frames, st.lists(st.integers(1, 50), min_size=1))
def test_frames_survive_any_split(items: list[tuple[int, int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(encode(kind, cid, payload) for kind, cid, payload in items)
    decoder = FrameDecoder()
    out: list[tuple[int, int, bytes]] = []
    pos = 0
    for n in cuts * (len(stream) // max(1, sum(cuts)) + 1):
        out += decoder.feed(stream[pos : pos + n])
        pos += n
    out += decoder.feed(stream[pos:])
    assert out == items


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (guest.HEADER.pack(9, 1, 0), "unknown frame type 9"),
        (guest.HEADER.pack(DATA, 1, MAX_DATA + 1), "DATA frame of 65537 bytes"),
        (guest.HEADER.pack(DATA, 1, 0), "DATA frame of 0 bytes"),
        (guest.HEADER.pack(WINDOW, 1, 8), "WINDOW frame of 8 bytes"),
        (guest.HEADER.pack(OPEN, 1, 2), "OPEN frame of 2 bytes"),
        (guest.HEADER.pack(EOF, 1, 1), "EOF frame of 1 bytes"),
    ],
)
def test_bad_headers_are_refused_before_their_payload(header: bytes, message: str) -> None:
    with pytest.raises(LinkError, match=message):
        FrameDecoder().feed(header)  # no payload needed: the header alone is refused


# ---- the host multiplexer against a fake guest ---------------------------------------------


class FakeGuest:
    """The guest end of a link, speaking raw frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.pending: list[tuple[int, int, bytes]] = []

    def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))

    async def _more(self) -> None:
        data = await self.reader.read(65536)
        if not data:
            raise EOFError("the host closed the link")
        self.pending += self.decoder.feed(data)

    async def frame(self) -> tuple[int, int, bytes]:
        """The next frame, whatever it is."""
        async with asyncio.timeout(10):
            while not self.pending:
                await self._more()
        return self.pending.pop(0)

    async def expect(self, kind: int, cid: int) -> bytes:
        """The payload of the first ``kind`` frame of ``cid`` (frames of other connections
        and kinds stay queued: the two directions of a connection are not ordered)."""
        async with asyncio.timeout(10):
            while True:
                for i, (k, c, payload) in enumerate(self.pending):
                    if (k, c) == (kind, cid):
                        del self.pending[i]
                        return payload
                await self._more()

    async def read_data(self, cid: int, size: int) -> bytes:
        """DATA of ``cid`` until ``size`` bytes."""
        out = b""
        while len(out) < size:
            out += await self.expect(DATA, cid)
        return out

    async def closed(self) -> bool:
        """Whether the host ends the link (EOF after any frames it still sent)."""
        with contextlib.suppress(EOFError, ConnectionResetError):
            while True:
                await self.frame()
        return True


class Upstreams:
    """Host unix servers standing for the proxy and the relays."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.servers: list[asyncio.Server] = []
        self.accepted = 0
        self.changed = asyncio.Condition()
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, name: str, handler: Handler) -> Path:
        path = self.tmp_path / name

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async with self.changed:
                self.accepted += 1
                self.changed.notify_all()
            self.writers.append(writer)
            try:
                await handler(reader, writer)
            except ConnectionError:
                pass
            finally:
                writer.close()

        self.servers.append(await asyncio.start_unix_server(counted, path=str(path)))
        return path

    async def wait_accepted(self, n: int) -> None:
        async with asyncio.timeout(5), self.changed:
            await self.changed.wait_for(lambda: self.accepted >= n)

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        for server in self.servers:
            server.close()
            await server.wait_closed()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write_eof()


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep the connection, answering nothing, until the peer goes away."""
    await reader.read()


@pytest.fixture
async def upstreams(tmp_path: Path) -> AsyncIterator[Upstreams]:
    ups = Upstreams(tmp_path)
    yield ups
    await ups.close()


@contextlib.asynccontextmanager
async def linked(
    forwarders: list[tuple[int, Path]], audit: AuditLog | None = None, **kwargs: int
) -> AsyncIterator[tuple[VmLink, FakeGuest]]:
    host_end, guest_end = socket.socketpair()
    link = VmLink(forwarders, audit, **kwargs)
    link.start(*await asyncio.open_connection(sock=host_end))
    fake = FakeGuest(*await asyncio.open_connection(sock=guest_end))
    try:
        yield link, fake
    finally:
        await link.close()
        fake.writer.close()


async def test_a_connection_carries_data_both_ways_and_half_closes(
    upstreams: Upstreams,
) -> None:
    path = await upstreams.serve("echo.sock", echo)
    async with linked([(3128, path)]) as (link, g):
        g.send(encode_u32(OPEN, 1, 0), encode(DATA, 1, b"hello"), encode(EOF, 1))
        assert await g.read_data(1, 5) == b"hello"
        await g.expect(EOF, 1)  # the echo server saw our EOF and ended its side
        assert WINDOW not in [kind for kind, _, _ in g.pending]  # 5 bytes: no grant yet
        task = link._conns[1].task
        assert task is not None
        async with asyncio.timeout(5):
            await task
        assert link.open_connections == 0
        g.send(encode_u32(WINDOW, 1, 5))  # stale after both EOFs: ignored
        g.send(encode_u32(OPEN, 2, 0), encode(DATA, 2, b"again"))
        assert await g.read_data(2, 5) == b"again"
        assert link.reason is None


async def test_delivered_bytes_are_granted_back_in_batches(upstreams: Upstreams) -> None:
    path = await upstreams.serve("echo.sock", echo)
    async with linked([(1, path)], window=1024) as (link, g):
        g.send(encode_u32(OPEN, 1, 0), encode(DATA, 1, b"a" * 200))
        assert await g.read_data(1, 200) == b"a" * 200  # echoed: delivered, not granted
        assert link._conns[1].budget == 1024 - 200
        g.send(encode(DATA, 1, b"b" * 100))
        assert u32(await g.expect(WINDOW, 1)) == 300  # a quarter of the window delivered
        assert link._conns[1].budget == 1024


class Recorder:
    """An upstream that reports what it got first, then when the host end went away."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.got: asyncio.Queue[bytes] = asyncio.Queue()
        self.ended: asyncio.Queue[bytes] = asyncio.Queue()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.got.put(await reader.readexactly(self.size))
        await self.ended.put(await reader.read())

    async def take(self, queue: asyncio.Queue[bytes], n: int) -> list[bytes]:
        async with asyncio.timeout(5):
            return [await queue.get() for _ in range(n)]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([encode(7, 1)], "unknown frame type 7"),
        ([guest.HEADER.pack(DATA, 1, 1 << 30)], "DATA frame of 1073741824 bytes"),
        ([encode_u32(OPEN, 1, 5)], "OPEN of forwarder 5; there are 1"),
        ([encode_u32(OPEN, 1, 0), encode_u32(OPEN, 1, 0)], "OPEN of connection 1, which is open"),
        ([encode_u32(OPEN, 1, 0), encode(DATA, 1, b"x" * 1025)], "window of 1024"),
        ([encode_u32(OPEN, 1, 0), encode_u32(WINDOW, 1, 1)], "granted 1 bytes"),
        ([encode_u32(OPEN, 1, 0), encode(EOF, 1), encode(DATA, 1, b"x")], "DATA after EOF"),
        ([encode_u32(OPEN, 1, 0), encode(EOF, 1), encode(EOF, 1)], "second EOF"),
    ],
)
async def test_a_frame_breaking_the_protocol_drops_the_link_and_is_audited(
    upstreams: Upstreams, tmp_path: Path, frames: list[bytes], reason: str
) -> None:
    path = await upstreams.serve("hold.sock", hold)
    audit = AuditLog(tmp_path / "audit.jsonl", "box")
    async with linked([(3128, path)], audit, window=1024) as (link, g):
        g.send(*frames)
        assert await g.closed()
        assert reason in await link.wait_closed()
        assert link.open_connections == 0
    records = [r for r in read_records(tmp_path / "audit.jsonl") if r["kind"] == "network"]
    assert len(records) == 1 and records[0]["protocol"] == "vmlink", records
    assert reason in records[0]["reason"]


async def test_garbage_never_raises_on_the_host(upstreams: Upstreams) -> None:
    path = await upstreams.serve("echo.sock", echo)
    for junk in (os.urandom(4096), b"\x02" + b"\xff" * 8, b"\x01\0\0\0\1\0\0\0\4\xff\xff\xff\xff"):
        async with linked([(3128, path)]) as (link, g):
            g.send(junk)
            g.writer.write_eof()
            reason = await link.wait_closed()
            assert reason.startswith(("protocol violation", "the guest closed")), reason


async def test_the_host_never_sends_beyond_the_guests_window(upstreams: Upstreams) -> None:
    """A guest that stops granting gets exactly its window; other connections go on."""
    flood = b"y" * (4 * WINDOW_SIZE)

    async def firehose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(flood)
        await writer.drain()
        writer.write_eof()
        await reader.read()

    hose = await upstreams.serve("hose.sock", firehose)
    path = await upstreams.serve("echo.sock", echo)
    async with linked([(1, hose), (2, path)]) as (link, g):
        g.send(encode_u32(OPEN, 1, 0))
        got = await g.read_data(1, WINDOW_SIZE)
        assert len(got) == WINDOW_SIZE
        # the stalled connection does not hold up another one
        g.send(encode_u32(OPEN, 2, 1), encode(DATA, 2, b"ping"))
        assert await g.read_data(2, 4) == b"ping"
        assert link._conns[1].credit == 0  # nothing more was sent on 1
        g.send(encode_u32(WINDOW, 1, 1000))
        assert len(await g.read_data(1, 1000)) == 1000
        # granting everything delivers the rest, then EOF
        g.send(encode_u32(WINDOW, 1, WINDOW_SIZE - 1000))
        received = WINDOW_SIZE + 1000
        while received < len(flood):
            chunk = await g.read_data(1, 1)
            received += len(chunk)
            g.send(encode_u32(WINDOW, 1, len(chunk)))
        assert received == len(flood)
        await g.expect(EOF, 1)


async def test_connections_beyond_the_cap_are_refused_and_audited(
    upstreams: Upstreams, tmp_path: Path
) -> None:
    path = await upstreams.serve("hold.sock", hold)
    audit = AuditLog(tmp_path / "audit.jsonl", "box")
    async with linked([(8080, path)], audit, max_conns=4) as (link, g):
        g.send(*(encode_u32(OPEN, cid, 0) for cid in range(1, 6)))
        await g.expect(CLOSE, 5)
        assert link.open_connections == 4
        g.send(encode(CLOSE, 2), encode_u32(OPEN, 6, 0))
        await upstreams.wait_accepted(5)  # 6 was let in: the slot of 2 was free
        assert link.open_connections == 4 and link.reason is None
    denials = [r for r in read_records(tmp_path / "audit.jsonl") if r.get("action") == "deny"]
    assert len(denials) == 1 and "more than 4 connections" in denials[0]["reason"]
    assert denials[0]["port"] == 8080


async def test_an_unreachable_upstream_is_a_close_and_an_audit_record(
    tmp_path: Path,
) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "box")
    async with linked([(3128, tmp_path / "missing.sock")], audit) as (link, g):
        g.send(encode_u32(OPEN, 1, 0), encode(DATA, 1, b"early"))
        await g.expect(CLOSE, 1)
        assert link.reason is None
    (record,) = read_records(tmp_path / "audit.jsonl")
    assert record["action"] == "error" and "missing.sock" in record["reason"]


async def test_a_guest_close_resets_the_upstream(upstreams: Upstreams) -> None:
    recorder = Recorder(7)
    path = await upstreams.serve("rec.sock", recorder)
    async with linked([(1, path)]) as (link, g):
        g.send(encode_u32(OPEN, 1, 0), encode(DATA, 1, b"partial"))
        assert await recorder.take(recorder.got, 1) == [b"partial"]
        g.send(encode(CLOSE, 1))
        assert await recorder.take(recorder.ended, 1) == [b""]
        assert link.open_connections == 0


async def test_losing_the_link_closes_every_upstream(upstreams: Upstreams) -> None:
    recorder = Recorder(1)
    path = await upstreams.serve("rec.sock", recorder)
    async with linked([(1, path)]) as (link, g):
        g.send(*(encode_u32(OPEN, cid, 0) for cid in range(1, 11)))
        g.send(*(encode(DATA, cid, b"a") for cid in range(1, 11)))
        assert await recorder.take(recorder.got, 10) == [b"a"] * 10
        g.writer.close()
        assert await link.wait_closed() == "the guest closed the link"
        assert await recorder.take(recorder.ended, 10) == [b""] * 10
        assert link.open_connections == 0


async def test_close_is_idempotent_and_ends_the_link(upstreams: Upstreams) -> None:
    path = await upstreams.serve("echo.sock", echo)
    async with linked([(1, path)]) as (link, g):
        g.send(encode_u32(OPEN, 1, 0))
        await link.close()
        await link.close()
        assert await link.wait_closed() == "closed by the host"
        assert await g.closed()


# ---- the real guest threads against the real host ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def guest_and_host(
    forwarders: list[tuple[int, Path]],
) -> AsyncIterator[tuple[guest.GuestLink, VmLink]]:
    host_end, guest_end = socket.socketpair()
    link = VmLink(forwarders)
    link.start(*await asyncio.open_connection(sock=host_end))
    g = guest.GuestLink(guest_end.fileno())
    g.listen([port for port, _ in forwarders])
    g.start()
    try:
        yield g, link
    finally:
        g.close()
        await link.close()  # the guest's reader sees EOF and ends
        assert g.reader is not None
        await asyncio.to_thread(g.reader.join, 10)
        guest_end.close()


async def exchange(port: int, payload: bytes, family: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection(family, port)
    try:
        writer.write(payload)
        writer.write_eof()
        async with asyncio.timeout(20):
            return await reader.read()
    finally:
        writer.close()


async def test_guest_and_host_carry_megabytes_intact(upstreams: Upstreams) -> None:
    path = await upstreams.serve("echo.sock", echo)
    port = free_port()
    async with guest_and_host([(port, path)]):
        payload = os.urandom(3 << 20)
        assert await exchange(port, payload) == payload
        assert await exchange(port, b"v6", "::1") == b"v6"


async def test_many_connections_at_once(upstreams: Upstreams) -> None:
    path = await upstreams.serve("echo.sock", echo)
    port = free_port()
    async with guest_and_host([(port, path)]) as (_, link):
        payloads = [os.urandom(1000 + i) for i in range(200)]
        results = await asyncio.gather(*(exchange(port, p) for p in payloads))
        assert results == payloads
        async with asyncio.timeout(5):
            await asyncio.gather(*(c.task for c in list(link._conns.values()) if c.task))
        assert link.open_connections == 0


async def test_the_guest_refuses_connections_beyond_its_cap(
    upstreams: Upstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guest, "MAX_CONNS", 3)
    path = await upstreams.serve("hold.sock", hold)
    port = free_port()
    async with guest_and_host([(port, path)]) as (_, link):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await upstreams.wait_accepted(3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed at once by the guest
        writer.close()
        assert link.open_connections == 3 and upstreams.accepted == 3
        for _, w in held:
            w.close()


async def test_a_refused_upstream_closes_the_guest_connection(tmp_path: Path) -> None:
    port = free_port()
    async with guest_and_host([(port, tmp_path / "missing.sock")]):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        async with asyncio.timeout(5):
            with contextlib.suppress(ConnectionResetError):
                assert await reader.read() == b""
        writer.close()


async def test_when_the_link_ends_guest_connections_end_too(upstreams: Upstreams) -> None:
    path = await upstreams.serve("hold.sock", hold)
    port = free_port()
    async with guest_and_host([(port, path)]) as (_, link):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await upstreams.wait_accepted(1)
        await link.close()
        async with asyncio.timeout(5):
            with contextlib.suppress(ConnectionResetError):
                assert await reader.read() == b""
        writer.close()
        late_r, late_w = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(5):
            assert await late_r.read() == b""  # refused: no link
        late_w.close()


def test_start_writes_the_files_and_listens(tmp_path: Path) -> None:
    fifo = tmp_path / "port"
    os.mkfifo(fifo)
    port = free_port()
    preload = tmp_path / "net" / "node_proxy.js"
    link = guest.start(
        {"device": str(fifo), "forwarders": [{"port": port}], "files": {str(preload): "js"}}
    )
    try:
        assert preload.read_text() == "js" and preload.stat().st_mode & 0o777 == 0o644
        assert [s.getsockname()[1] for s, _ in link.listeners][:1] == [port]
    finally:
        link.close()
        with open(fifo, "wb") as f:  # a bad frame ends the reader thread
            f.write(encode(9, 0))
        assert link.reader is not None
        link.reader.join(10)
        assert not link.reader.is_alive()
        os.close(link.fd)


def test_window_frames_decode() -> None:
    assert u32(encode_u32(WINDOW, 1, 77)[9:]) == 77
