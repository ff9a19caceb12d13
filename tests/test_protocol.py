from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.agent import protocol


def test_roundtrip_header_and_payload() -> None:
    frame = protocol.encode({"op": "spawn", "id": 1}, b"\x00\xffdata")
    assert protocol.FrameDecoder().feed(frame) == [({"op": "spawn", "id": 1}, b"\x00\xffdata")]


@given(
    st.lists(
        st.tuples(st.dictionaries(st.text(max_size=5), st.integers()), st.binary(max_size=50)),
        max_size=5,
    ),
    st.lists(st.integers(min_value=1, max_value=40), min_size=1),
)
def test_any_chunking_yields_the_same_frames(
    frames: list[tuple[dict[str, int], bytes]], cuts: list[int]
) -> None:
    stream = b"".join(protocol.encode(h, p) for h, p in frames)
    decoder = protocol.FrameDecoder()
    out = []
    pos = 0
    i = 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        out += decoder.feed(stream[pos : pos + step])
        pos += step
        i += 1
    assert out == frames


@pytest.mark.parametrize(
    "raw",
    [
        protocol.HEADER.pack(0, 0),
        protocol.HEADER.pack(protocol.MAX_HEADER + 1, 0),
        protocol.HEADER.pack(2, protocol.MAX_PAYLOAD + 1),
        protocol.HEADER.pack(2, 0) + b"[]",
        protocol.HEADER.pack(3, 0) + b"{x}",
        protocol.HEADER.pack(2, 0) + b"\xff\xfe",
    ],
)
def test_malformed_frames_are_rejected(raw: bytes) -> None:
    with pytest.raises(protocol.FrameError):
        protocol.FrameDecoder().feed(raw)
