"""A compromised guest agent: forged and malformed frames to the host's decoder.

A fake backend hands the Sandbox one end of a socketpair; a scripted "agent" on the other end
answers ``ready`` and then misbehaves. The host must end the sandbox with a structured error
(``SandboxBroken`` / ``ProtocolError`` with a code), never crash, hang or grow without bound.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox, errors
from corral.agent import protocol
from corral.backends.base import BoxSpec, BoxStats
from corral.channel import Channel

pytestmark = pytest.mark.attack("protocol")

Frame = tuple[dict[str, Any], bytes]
# A script gets each request the host sends and returns the raw bytes to answer with.
Script = Callable[[dict[str, Any]], Awaitable[bytes]]


def frame(header: object, payload: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return struct.pack(">II", len(body), len(payload)) + body + payload


def raw(hlen: int, plen: int, body: bytes = b"") -> bytes:
    return struct.pack(">II", hlen, plen) + body


class FakeBox:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.closed = False

    @property
    def channel(self) -> socket.socket:
        return self._sock

    @property
    def warnings(self) -> tuple[str, ...]:
        return ()

    @property
    def heartbeat_timeout(self) -> float:
        return 30.0

    @property
    def user_ids(self) -> tuple[int, int]:
        return (65534, 65534)

    @property
    def root_layer(self) -> None:
        return None

    def stats(self) -> BoxStats:
        return BoxStats()

    def oom_kills(self) -> int:
        return 0

    def pids_limit_hits(self) -> int:
        return 0

    def observe_counters(self, counters: object) -> None:
        pass

    def stop(self) -> None:
        self._sock.close()

    def describe(self) -> dict[str, Any]:
        return {"backend": "fake"}

    async def diagnose(self) -> str:
        return ""

    def check_layout(self) -> None:
        pass

    async def freeze(self, frozen: bool) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
        self._sock.close()


class FakeAgent:
    """Sends ``ready``, then answers each request with what the script returns."""

    name = "fake"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.box: FakeBox | None = None
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def for_policy(cls, policy: Policy) -> FakeAgent:
        raise NotImplementedError

    async def start(self, spec: BoxSpec) -> FakeBox:
        host, guest = socket.socketpair()
        host.setblocking(False)
        guest.setblocking(False)
        self.box = FakeBox(host)
        self.task = asyncio.create_task(self._serve(guest))
        return self.box

    async def _serve(self, guest: socket.socket) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=guest)
        try:
            writer.write(frame({"ev": "ready", "pid": 1}))
            decoder = protocol.FrameDecoder()
            while data := await reader.read(65536):
                for header, _ in decoder.feed(data):
                    answer = await self.script(header)
                    if answer == b"EOF":
                        return
                    writer.write(answer)
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


def ok_reply(header: dict[str, Any], **fields: Any) -> bytes:
    if header["op"] == "spawn":
        fields.setdefault("pid", 7)
    return frame({"re": header["id"], **fields})


@pytest.fixture
async def fake_sandbox(
    tmp_path: Path,
) -> AsyncIterator[Callable[[Script], Awaitable[Sandbox]]]:
    boxes: list[Sandbox] = []

    async def make(script: Script) -> Sandbox:
        sb = Sandbox(Policy(), workspace=tmp_path, backend=FakeAgent(script))
        boxes.append(sb)
        async with asyncio.timeout(5):
            await sb.start()
        return sb

    yield make
    for sb in boxes:
        async with asyncio.timeout(10):
            await sb.aclose()


async def _breaks(make: Callable[[Script], Awaitable[Sandbox]], bad: bytes) -> errors.SandboxError:
    """The agent answers the first request with ``bad``: the call must fail, structured."""

    async def script(header: dict[str, Any]) -> bytes:
        return bad

    sb = await make(script)
    async with asyncio.timeout(5):
        with pytest.raises(errors.SandboxError) as caught:
            await sb.run("true")
    err = caught.value
    assert err.to_dict()["error"]["code"] in ("sandbox_broken", "protocol_error")
    # Broken for good, and still structured; closing does not hang.
    with pytest.raises(errors.SandboxBroken):
        await sb.run("true")
    return err


@pytest.mark.parametrize(
    "bad",
    [
        raw(protocol.MAX_HEADER + 1, 0),
        raw(0xFFFFFFFF, 0xFFFFFFFF),
        raw(10, protocol.MAX_PAYLOAD + 1),
        raw(0, 0),
    ],
    ids=["header-over-limit", "both-lengths-max", "payload-over-limit", "empty-header"],
)
async def test_oversize_and_zero_lengths(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]], bad: bytes
) -> None:
    err = await _breaks(fake_sandbox, bad)
    assert "protocol violation" in err.message


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe not json", b"[1, 2, 3]", b'"string"', b"null", b'{"re": 1,'],
    ids=["not-utf8", "array", "string", "null", "truncated-json"],
)
async def test_non_object_headers(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]], body: bytes
) -> None:
    await _breaks(fake_sandbox, raw(len(body), 0, body))


@pytest.mark.parametrize(
    "header",
    [
        {"re": 9999},
        {"re": "1"},
        {"re": None},
        {"ev": "nonsense", "pid": 7},
        {"ev": "out", "pid": 7, "stream": "secret"},
        {"ev": "out", "pid": "7", "stream": "stdout"},
        {"ev": "exit", "pid": 7, "exit_code": True},
        {"ev": "exit", "pid": 7, "exit_code": "0"},
        {"op": "spawn", "id": 1},
    ],
    ids=[
        "reply-unknown-id",
        "reply-string-id",
        "reply-null-id",
        "unknown-event",
        "unknown-stream",
        "string-pid",
        "bool-exit-code",
        "string-exit-code",
        "agent-sends-a-request",
    ],
)
async def test_forged_replies_and_events(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]], header: dict[str, Any]
) -> None:
    await _breaks(fake_sandbox, frame(header))


@pytest.mark.parametrize("pid", [0, -1, True, "7", None, 2**70])
async def test_spawn_reply_with_a_bad_pid(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]], pid: object
) -> None:
    async def script(header: dict[str, Any]) -> bytes:
        return frame({"re": header["id"], "pid": pid})

    sb = await fake_sandbox(script)
    async with asyncio.timeout(5):
        with pytest.raises(errors.SandboxError) as caught:
            await sb.run("true")
    assert caught.value.code in (errors.ErrorCode.SANDBOX_BROKEN, errors.ErrorCode.PROTOCOL_ERROR)


async def test_events_for_unknown_pids_are_ignored(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    """Output and exits of pids the host never started must not feed any process."""

    async def script(header: dict[str, Any]) -> bytes:
        junk = frame({"ev": "out", "pid": 4242, "stream": "stdout"}, b"forged")
        junk += frame({"ev": "exit", "pid": 4243, "exit_code": 0})
        if header["op"] == "spawn":
            return (
                junk
                + ok_reply(header)
                + frame({"ev": "out", "pid": 7, "stream": "stdout"}, b"real")
                + frame({"ev": "exit", "pid": 7, "exit_code": 0})
            )
        return junk + ok_reply(header)

    sb = await fake_sandbox(script)
    async with asyncio.timeout(5):
        r = await sb.run("true")
    assert r.stdout == "real" and r.exit_code == 0
    assert [p.pid for p in sb.registry.list()] == [7]


async def test_malformed_error_replies_are_structured(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    replies: Iterator[dict[str, Any]] = iter(
        [
            {"error": "not a dict"},
            {"error": {"code": "invalid_input", "message": "x" * 100_000}},
            {"error": {"code": ["weird"], "message": {"nested": 1}}},
        ]
    )

    async def script(header: dict[str, Any]) -> bytes:
        return frame({"re": header["id"], **next(replies)})

    sb = await fake_sandbox(script)
    caught = []
    for _ in range(3):
        async with asyncio.timeout(5):
            with pytest.raises(errors.SandboxError) as exc:
                await sb.files.read("x")
        caught.append(exc.value)
    assert caught[0].code == errors.ErrorCode.PROTOCOL_ERROR
    assert caught[1].code == errors.ErrorCode.INVALID_INPUT and len(caught[1].message) <= 2000
    assert caught[2].to_dict()["error"]["code"]


async def test_agent_hangs_up_mid_request(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    await _breaks(fake_sandbox, b"EOF")


async def test_truncated_frame_then_silence_is_bounded(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    """Half a frame and then nothing: the call waits for its own timeout, not forever."""

    async def script(header: dict[str, Any]) -> bytes:
        return raw(100, 0, b'{"re"')

    sb = await fake_sandbox(script)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await sb.files.read("x")
    async with asyncio.timeout(10):
        await sb.aclose()


async def test_output_flood_from_a_forged_agent_is_capped(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    """64 MiB of output events for one process: the host keeps head and tail only."""
    chunk = b"A" * (1 << 20)

    async def script(header: dict[str, Any]) -> bytes:
        if header["op"] != "spawn":
            return ok_reply(header)
        flood = frame({"ev": "out", "pid": 7, "stream": "stdout"}, chunk) * 64
        return ok_reply(header) + flood + frame({"ev": "exit", "pid": 7, "exit_code": 0})

    sb = await fake_sandbox(script)
    async with asyncio.timeout(30):
        r = await sb.run("true")
    assert r.truncated and len(r.stdout) <= 2 * sb.policy.limits.output_bytes


async def test_agent_that_never_gets_ready() -> None:
    host, guest = socket.socketpair()
    host.setblocking(False)
    try:
        channel = Channel(host, lambda header, payload: None)
        await channel.start()
        with pytest.raises(errors.BackendError):
            await channel.wait_ready(0.3)
        await channel.close()
    finally:
        guest.close()
        host.close()


async def test_a_spawn_cancelled_before_its_reply_ends_the_command(
    fake_sandbox: Callable[[Script], Awaitable[Sandbox]],
) -> None:
    """The agent started the command, but its caller was cancelled before the reply came:
    nobody holds a handle, so the host ends the command itself (TERM, grace, KILL)."""
    got_spawn, release, terminated = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def script(header: dict[str, Any]) -> bytes:
        if header["op"] == "spawn":
            got_spawn.set()
            await release.wait()
        if header["op"] == "terminate":
            terminated.set()
            exit_event = frame({"ev": "exit", "pid": 7, "exit_code": -15})
            return ok_reply(header, delivered=True) + exit_event
        return ok_reply(header)

    sb = await fake_sandbox(script)
    run = asyncio.create_task(sb.run("sleep 100"))
    async with asyncio.timeout(5):
        await got_spawn.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    release.set()
    async with asyncio.timeout(5):
        await terminated.wait()
        assert (await sb.process(7).wait()).exit_code == -15
