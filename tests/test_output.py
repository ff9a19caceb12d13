"""Tests for corral.output: decoding, ANSI stripping and capped output buffers."""

from __future__ import annotations

import codecs
import itertools
import time
from typing import AnyStr

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.errors import ErrorCode, SandboxError
from corral.output import AnsiStripper, HeadTailBuffer, IncrementalDecoder, cap_text, strip_ansi


def split_at(data: AnyStr, cuts: list[int]) -> list[AnyStr]:
    """Split ``data`` at the given (unsorted, possibly duplicate) positions."""
    points: list[int] = sorted({min(c, len(data)) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


cuts_strategy = st.lists(st.integers(min_value=0, max_value=400), max_size=12)

# Text rich in the characters that matter to the stripper.
ansi_alphabet = st.sampled_from(list("\x1b[]P\\\x07\r\n\tm0;31? aé\x9b\x00(B_"))
ansi_text = st.lists(ansi_alphabet, max_size=60).map("".join)


# --- IncrementalDecoder -------------------------------------------------------------------


def test_decoder_joins_multibyte_char_split_across_feeds() -> None:
    decoder = IncrementalDecoder()
    data = "h€llo".encode()
    assert decoder.feed(data[:2]) == "h"
    assert decoder.feed(data[2:3]) == ""
    assert decoder.feed(data[3:]) == "€llo"
    assert decoder.flush() == ""


def test_decoder_replaces_invalid_bytes_and_flushes_incomplete_char() -> None:
    decoder = IncrementalDecoder()
    assert decoder.feed(b"a\xffb") == "a\ufffdb"
    assert decoder.feed(b"\xe2\x82") == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.feed(b"ok") == "ok"


@given(st.text(), cuts_strategy)
def test_decoder_any_chunking_of_valid_utf8_gives_same_text(text: str, cuts: list[int]) -> None:
    decoder = IncrementalDecoder()
    chunks = split_at(text.encode(), cuts)
    assert "".join(decoder.feed(chunk) for chunk in chunks) + decoder.flush() == text


@given(st.binary(max_size=200), cuts_strategy)
def test_decoder_any_chunking_of_arbitrary_bytes_matches_one_shot(
    data: bytes, cuts: list[int]
) -> None:
    decoder = IncrementalDecoder()
    chunks = split_at(data, cuts)
    out = "".join(decoder.feed(chunk) for chunk in chunks) + decoder.flush()
    assert out == data.decode("utf-8", "replace")


# --- strip_ansi / AnsiStripper ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("\x1b[1;31mred\x1b[0m plain", "red plain"),
        ("\x1b[?2004hprompt$ ", "prompt$ "),
        ("\x1b]0;user@host: ~\x07$ ", "$ "),
        ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"),
        ("\x1b]0;title\x1b[32mgreen", "green"),
        ("\x1b(Bcharset\x1b=", "charset"),
        ("line1\r\nline2\r\n", "line1\nline2\n"),
        ("10%\r50%\r100%", "10%50%100%"),
        ("tab\there\x08\x00\x7f", "tab\there"),
        ("unterminated \x1b[12", "unterminated 12"),
        ("héllo wörld", "héllo wörld"),
    ],
)
def test_strip_ansi_removes_sequences_and_controls(raw: str, clean: str) -> None:
    assert strip_ansi(raw) == clean


def test_stripper_holds_back_sequence_split_across_feeds() -> None:
    stripper = AnsiStripper()
    assert stripper.feed("ok \x1b[3") == "ok "
    assert stripper.feed("1mred\x1b]0;ti") == "red"
    assert stripper.feed("tle\x07done\x1b") == "done"
    assert stripper.feed("[0m!") == "!"
    assert stripper.flush() == ""


def test_stripper_gives_up_on_endless_unterminated_sequence() -> None:
    stripper = AnsiStripper()
    out = stripper.feed("\x1b]" + "x" * 10_000)
    assert out.endswith("x" * 100)  # emitted rather than buffered forever


@given(ansi_text, cuts_strategy)
def test_stripper_any_chunking_equals_one_shot(text: str, cuts: list[int]) -> None:
    stripper = AnsiStripper()
    chunks = split_at(text, cuts)
    out = "".join(stripper.feed(chunk) for chunk in chunks) + stripper.flush()
    assert out == strip_ansi(text)


@given(ansi_text)
def test_strip_ansi_output_has_no_escape_or_control_chars(text: str) -> None:
    out = strip_ansi(text)
    assert all(ch in "\n\t" or (ch >= " " and not "\x7f" <= ch <= "\x9f") for ch in out)


# --- HeadTailBuffer -----------------------------------------------------------------------


def test_head_tail_buffer_keeps_everything_under_cap() -> None:
    buf = HeadTailBuffer(10)
    buf.append(b"hello")
    buf.append(b"")
    assert (buf.getvalue(), buf.total, buf.truncated, buf.dropped) == (b"hello", 5, False, 0)
    assert buf.render() == "hello"


def test_head_tail_buffer_render_marks_dropped_bytes() -> None:
    buf = HeadTailBuffer(8)
    for chunk in (b"0123", b"4567", b"89ab"):
        buf.append(chunk)
    assert buf.getvalue() == b"012389ab"
    assert (buf.total, buf.truncated, buf.dropped) == (12, True, 4)
    assert buf.render() == "0123\n[... 4 bytes truncated ...]\n89ab"


def test_head_tail_buffer_render_drops_chars_cut_by_the_gap() -> None:
    buf = HeadTailBuffer(6)
    buf.append("ab€€cd".encode())  # head b"ab\xe2", tail b"\xaccd": both cut a "€"
    assert buf.render() == "ab\n[... 4 bytes truncated ...]\ncd"


def test_head_tail_buffer_rejects_negative_cap() -> None:
    with pytest.raises(SandboxError) as info:
        HeadTailBuffer(-1)
    assert info.value.code == ErrorCode.INVALID_INPUT


def test_head_tail_buffer_zero_cap_holds_nothing() -> None:
    buf = HeadTailBuffer(0)
    buf.append(b"abc")
    assert (buf.getvalue(), buf.dropped) == (b"", 3)
    assert buf.read_since(0) == (b"", 3, True)


def test_head_tail_buffer_appending_50mb_in_64k_chunks_is_fast() -> None:
    buf = HeadTailBuffer(1 << 20)
    chunk = bytes(range(256)) * 256  # 64 KiB
    started = time.perf_counter()
    for _ in range(800):  # 50 MiB
        buf.append(chunk)
    elapsed = time.perf_counter() - started
    assert buf.total == 800 * len(chunk)
    assert len(buf.getvalue()) == 1 << 20
    assert elapsed < 2.0, f"50 MiB of appends took {elapsed:.2f}s"


def test_head_tail_buffer_read_since_reports_gap() -> None:
    buf = HeadTailBuffer(4)
    buf.append(b"ab")
    assert buf.read_since(0) == (b"ab", 2, False)
    buf.append(b"cdef")
    assert buf.read_since(2) == (b"ef", 6, True)
    assert buf.read_since(6) == (b"", 6, False)
    with pytest.raises(SandboxError) as info:
        buf.read_since(7)
    assert info.value.code == ErrorCode.INVALID_INPUT


@given(
    st.integers(min_value=0, max_value=40),
    st.lists(st.binary(max_size=30), max_size=12),
    st.data(),
)
def test_head_tail_buffer_holds_head_and_latest_tail(
    cap: int, chunks: list[bytes], data: st.DataObject
) -> None:
    buf = HeadTailBuffer(cap)
    for chunk in chunks:
        buf.append(chunk)
    whole = b"".join(chunks)
    head, tail = cap // 2, cap - cap // 2
    assert buf.total == len(whole)
    assert buf.truncated == (len(whole) > cap)
    if buf.truncated:
        assert buf.getvalue() == whole[:head] + whole[len(whole) - tail :]
        assert buf.dropped == len(whole) - cap
    else:
        assert buf.getvalue() == whole
        assert buf.dropped == 0

    offset = data.draw(st.integers(min_value=0, max_value=len(whole)))
    got, new_offset, lost = buf.read_since(offset)
    assert new_offset == len(whole)
    held_head = min(head, len(whole))
    tail_start = max(held_head, len(whole) - tail)
    assert got == whole[offset:held_head] + whole[max(offset, tail_start) :]
    assert lost == (max(offset, held_head) < tail_start)
    if not lost:
        assert got == whole[offset:]


@given(st.lists(st.binary(max_size=30), max_size=12), st.integers(min_value=0, max_value=20))
def test_head_tail_buffer_polling_sees_every_held_byte_once(chunks: list[bytes], cap: int) -> None:
    buf = HeadTailBuffer(cap)
    offset, seen, lost_any = 0, b"", False
    for chunk in chunks:
        buf.append(chunk)
        got, offset, lost = buf.read_since(offset)
        seen += got
        lost_any |= lost
    whole = b"".join(chunks)
    assert offset == len(whole)
    if not lost_any:
        assert seen == whole


# --- cap_text -----------------------------------------------------------------------------


def test_cap_text_leaves_short_text_alone() -> None:
    assert cap_text("short", 5) == ("short", False)


def test_cap_text_keeps_head_and_tail_and_counts_cut() -> None:
    text = "a" * 10 + "b" * 80 + "c" * 10
    capped, truncated = cap_text(text, 20)
    assert truncated
    assert capped == "a" * 10 + "\n[... 80 chars truncated ...]\n" + "c" * 10


def test_cap_text_with_zero_limit_keeps_only_marker() -> None:
    assert cap_text("abc", 0) == ("\n[... 3 chars truncated ...]\n", True)


def test_cap_text_rejects_negative_limit() -> None:
    with pytest.raises(SandboxError) as info:
        cap_text("abc", -1)
    assert info.value.code == ErrorCode.INVALID_INPUT


def test_head_tail_buffer_holds_no_more_than_the_cap_and_one_chunk() -> None:
    """Memory is sized to the cap: the tail drops superseded chunks as it goes (a capture
    held up to 1.5x the cap before, and rendering copied it three times more)."""
    buf = HeadTailBuffer(1 << 20)
    chunk = bytes(range(256)) * 256  # 64 KiB
    for _ in range(200):
        buf.append(chunk)
    held = len(buf._head) + sum(len(c) for c in buf._chunks)
    assert held <= (1 << 20) + len(chunk), held
    assert buf.getvalue() == (chunk * 8) + (chunk * 200)[-(1 << 19) :]


def _render_reference(kept: bytes, head_len: int, dropped: int) -> str:
    """What render() means, from the kept bytes whole (head, then tail)."""
    if not dropped:
        return kept.decode("utf-8", "replace")
    head = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(kept[:head_len])
    tail = kept[head_len:]
    skip = 0
    while skip < min(3, len(tail)) and 0x80 <= tail[skip] <= 0xBF:
        skip += 1
    return (
        head + f"\n[... {dropped} bytes truncated ...]\n" + tail[skip:].decode("utf-8", "replace")
    )


@given(
    st.integers(min_value=0, max_value=40),
    st.lists(
        st.lists(
            st.sampled_from([b"a", b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xff"])
        ).map(b"".join),
        max_size=12,
    ),
    st.data(),
)
def test_head_tail_buffer_render_is_the_decoded_kept_bytes_however_chunked(
    cap: int, texts: list[bytes], data: st.DataObject
) -> None:
    """Rendering chunk by chunk (characters split between chunks, between head and tail)
    equals decoding what is kept at once."""
    whole = b"".join(texts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=8)))
    buf = HeadTailBuffer(cap)
    for start, end in itertools.pairwise([0, *cuts, len(whole)]):
        buf.append(whole[start:end])
    assert buf.render() == _render_reference(buf.getvalue(), min(cap // 2, len(whole)), buf.dropped)
