"""Fuzzing with hypothesis: policy dicts and TOML files, the host's decoder of agent frames and
replies, tool inputs through the toolbox, expect patterns. Nothing may crash or hang; every
rejection is the structured error of its layer."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral import Policy, Sandbox, errors
from corral.agent import protocol
from corral.channel import error_from_reply
from corral.sessions.expect import Case, ExpectBuffer
from corral.tools import Toolbox
from corral.tools.catalog import TOOLS

pytestmark = pytest.mark.fuzz
FAST = settings(
    max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
POLICY_KEYS = [
    "backend",
    "runtime",
    "filesystem",
    "network",
    "limits",
    "security",
    "env",
    "workdir",
    "audit_log",
    "process_tracking",
    "vm",
    "secrets_file",
]
SUB_KEYS = [
    "memory_bytes",
    "max_pids",
    "cpu_quota",
    "mode",
    "ports",
    "allow_hosts",
    "deny_read",
    "tmp_size",
    "mounts",
    "preset",
    "rlimits",
    "output_bytes",
    "inherit_readable",
]


@st.composite
def policy_dicts(draw: st.DrawFn) -> dict[str, Any]:
    keys = st.sampled_from(POLICY_KEYS) | st.text(max_size=8)
    sub = st.dictionaries(st.sampled_from(SUB_KEYS) | st.text(max_size=6), json_values, max_size=4)
    return draw(st.dictionaries(keys, sub | json_values, max_size=5))


@FAST
@given(policy_dicts())
def test_policy_dicts(data: dict[str, Any]) -> None:
    try:
        Policy.from_dict(data)
    except errors.PolicyError as exc:
        message = exc.message
    else:
        return
    assert message.startswith("invalid policy")


@FAST
@given(
    st.text(max_size=200)
    | st.sampled_from(
        [
            "[limits]\nmemory_bytes = '12Q'\n",
            "backend = 'oci'\nruntime = 'x'\n",
            "[network]\nports = [0, 70000]\n",
        ]
    )
)
def test_policy_toml_files(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("pol") / "corral.toml"
    path.write_text(text)
    try:
        Policy.load(path)
    except errors.PolicyError as exc:
        message = exc.message
    else:
        return
    assert str(path) in message


@FAST
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_frame_decoder_on_arbitrary_bytes(chunks: list[bytes]) -> None:
    decoder = protocol.FrameDecoder()
    try:
        for chunk in chunks:
            for header, payload in decoder.feed(chunk):
                assert isinstance(header, dict) and isinstance(payload, bytes)
    except protocol.FrameError:
        pass


@FAST
@given(json_values, st.binary(max_size=32), st.integers(1, 7))
def test_frame_decoder_on_valid_frames_split_anywhere(
    header: Any, payload: bytes, parts: int
) -> None:
    body = json.dumps(header).encode()
    data = struct.pack(">II", len(body), len(payload)) + body + payload
    decoder = protocol.FrameDecoder()
    frames = []
    step = max(1, len(data) // parts)
    try:
        for i in range(0, len(data), step):
            frames += decoder.feed(data[i : i + step])
    except protocol.FrameError:
        assert not isinstance(header, dict)
        return
    assert frames == [(header, payload)]


@FAST
@given(json_values)
def test_error_replies_always_map_to_a_sandbox_error(err: Any) -> None:
    exc = error_from_reply({"re": 1, "error": err})
    assert isinstance(exc, errors.SandboxError)
    assert len(exc.message) <= 2000 and exc.to_dict()["error"]["code"]


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["re", "ev", "pid", "stream", "exit_code", "error"]),
        json_values,
        max_size=5,
    )
)
def test_channel_dispatch_of_arbitrary_headers(header: dict[str, Any]) -> None:
    """The host's dispatcher: a violation is a FrameError, never anything else."""
    import socket

    from corral.channel import Channel

    async def go() -> None:
        a, b = socket.socketpair()
        try:
            channel = Channel(a, lambda h, p: None)
            try:
                channel._dispatch(header, b"")
            except protocol.FrameError:
                pass
        finally:
            a.close()
            b.close()

    asyncio.run(go())


@pytest.fixture(scope="module")
def toolbox_loop() -> Iterator[tuple[Toolbox, asyncio.AbstractEventLoop]]:
    """Tools over a sandbox that was never started: valid calls fail (structured) before
    anything runs, so the fuzzer can throw anything at validation and error mapping."""
    loop = asyncio.new_event_loop()
    sb = Sandbox(Policy(), workspace=Path("/nonexistent"))
    yield Toolbox(sb), loop
    loop.close()


TOOL_NAMES = [t.name for t in TOOLS]


@FAST
@given(
    st.sampled_from(TOOL_NAMES) | st.text(max_size=12),
    st.dictionaries(
        st.sampled_from(
            [
                "command",
                "args",
                "path",
                "pid",
                "input",
                "pattern",
                "timeout",
                "content",
                "cases",
                "steps",
                "background",
                "signal",
                "code",
            ]
        )
        | st.text(max_size=6),
        json_values,
        max_size=4,
    )
    | json_values,
)
def test_tool_inputs(
    toolbox_loop: tuple[Toolbox, asyncio.AbstractEventLoop], name: str, arguments: Any
) -> None:
    tools, loop = toolbox_loop
    result = loop.run_until_complete(asyncio.wait_for(tools.call(name, arguments), 5))
    assert isinstance(result, dict)
    json.dumps(result)
    if "error" in result:
        assert isinstance(result["error"]["code"], str) and result["error"]["code"]
        assert isinstance(result["error"]["message"], str)
        assert result["error"]["code"] != "internal_error", result


regexish = st.text(alphabet="ab()[]{}*+?|.^$\\-0123,:dws", max_size=12)


@FAST
@given(regexish, st.none() | st.text(alphabet="ab$0123{}", max_size=8), st.binary(max_size=200))
def test_expect_patterns(pattern: str, respond: str | None, data: bytes) -> None:
    code: errors.ErrorCode | None = None
    try:
        case = Case(pattern, respond=respond)
    except errors.SandboxError as exc:
        code = exc.code
    if code is not None:
        assert code == errors.ErrorCode.INVALID_INPUT
        return
    buffer = ExpectBuffer(max_chars=256, strip_ansi=True)
    buffer.feed(data)
    found = buffer.match([case])
    if found is None:
        buffer.feed_eof()
        found = buffer.eof_result([case])
    assert isinstance(found.to_dict(), dict)
