"""Tests for corral.sessions.expect: cases, matching rules, chunking independence, results."""

from __future__ import annotations

import itertools
import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.errors import ErrorCode, ProtocolError, SandboxError
from corral.sessions.expect import Case, ExpectBuffer, Expecter, Match, expand_response


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def run_chunks(
    cases: list[Case], chunks: list[bytes], buffer: ExpectBuffer | None = None
) -> Match | None:
    """Drive an Expecter the way the I/O driver does, ending with EOF."""
    expecter = Expecter(buffer or ExpectBuffer(), cases)
    result = expecter.check()
    for chunk in chunks:
        result = result or expecter.feed(chunk)
    return result or expecter.feed_eof()


cuts_strategy = st.lists(st.integers(min_value=0, max_value=120), max_size=15)
small_text = st.text(alphabet="ab\n$é€ ", max_size=60)


# --- spec scenarios -----------------------------------------------------------------------


def test_expect_matches_terraform_prompt_and_returns_plan_output() -> None:
    plan = (
        "Terraform will perform the following actions:\n"
        "  # aws_instance.web will be created\n"
        "Plan: 1 to add, 0 to change, 0 to destroy.\n\n"
        "Do you want to perform these actions?\n"
        "  Enter a value: "
    )
    expecter = Expecter(ExpectBuffer(), [Case("Enter a value:")])
    data = plan.encode()
    assert expecter.feed(data[:50]) is None
    result = expecter.feed(data[50:])
    assert result is not None
    assert result.to_dict() == {
        "matched": True,
        "pattern": "Enter a value:",
        "output": plan.rstrip(" "),
        "captures": ["Enter a value:"],
    }


def test_cases_pick_earliest_match_and_report_tag_and_label() -> None:
    cases = [
        Case(r"[Pp]assword:", tag="password", label="sudo password", respond="hunter2\n"),
        Case(r"\(yes/no(/\[fingerprint\])?\)\?", tag="hostkey", respond="yes\n"),
        Case(r"\$ $", tag="prompt"),
    ]
    buffer = ExpectBuffer()
    buffer.feed(b"Warning: unknown host (yes/no/[fingerprint])? ")
    first = buffer.match(cases)
    assert first is not None
    assert (first.matched_case, first.tag, first.respond) == (1, "hostkey", "yes\n")
    buffer.feed(b"\r\nuser@host's password: ")
    second = buffer.match(cases)
    assert second is not None
    assert second.to_dict(cases=True) == {
        "matched": True,
        "pattern": "[Pp]assword:",
        "output": " \r\nuser@host's password:",
        "captures": ["password:"],
        "matched_case": 0,
        "tag": "password",
        "label": "sudo password",
    }
    assert second.respond == "hunter2\n"
    assert buffer.pending == " "


def test_cases_tie_at_same_start_goes_to_first_listed() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"password: ")
    result = buffer.match([Case("pass"), Case("password")])
    assert result is not None
    assert (result.matched_case, result.output) == (0, "pass")


def test_respond_expands_captures() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"tool version 3.12 ready\n")
    result = buffer.match([Case(r"version (\d+\.\d+)", respond="Detected version $1\n")])
    assert result is not None
    assert result.captures == ["version 3.12", "3.12"]
    assert result.respond == "Detected version 3.12\n"


def test_unmatched_optional_group_is_empty_string() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"xz")
    result = buffer.match([Case("x(y)?z")])
    assert result is not None
    assert result.captures == ["xz", ""]


# --- expand_response ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("$1-${2}", "a-b"),
        ("$0!", "whole!"),
        ("cost $$5", "cost $5"),
        ("echo $HOME $", "echo $HOME $"),
        ("$10", "a0"),
        ("${1}0", "a0"),
    ],
)
def test_expand_response_substitutes_references(template: str, expected: str) -> None:
    assert expand_response(template, ["whole", "a", "b"]) == expected


def test_case_rejects_response_referring_to_missing_group() -> None:
    with pytest.raises(SandboxError) as info:
        Case(r"version (\d+)", respond="got $2")
    assert info.value.code == ErrorCode.INVALID_INPUT
    assert "$2" in info.value.message


# --- invalid input ------------------------------------------------------------------------


def test_invalid_regex_raises_invalid_input_naming_pattern_and_error() -> None:
    with pytest.raises(SandboxError) as info:
        Case("(unclosed")
    assert info.value.code == ErrorCode.INVALID_INPUT
    assert "(unclosed" in info.value.message
    assert "missing )" in info.value.message


def test_expecter_needs_at_least_one_case() -> None:
    with pytest.raises(SandboxError) as info:
        Expecter(ExpectBuffer(), [])
    assert info.value.code == ErrorCode.INVALID_INPUT


def test_feeding_after_eof_is_a_protocol_error() -> None:
    buffer = ExpectBuffer()
    buffer.feed_eof()
    with pytest.raises(ProtocolError):
        buffer.feed(b"late")


# --- timeout, EOF, take -------------------------------------------------------------------


def test_timeout_is_a_result_and_keeps_pending_output() -> None:
    expecter = Expecter(ExpectBuffer(), [Case("never")])
    assert expecter.feed(b"some output") is None
    result = expecter.timeout()
    assert result.to_dict() == {
        "matched": False,
        "pattern": "never",
        "output": "some output",
        "captures": [],
        "reason": "timeout",
    }
    assert expecter.feed(b"more") is None  # resolved already; data still buffered


def test_timeout_with_consume_empties_buffer() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"abc")
    result = Expecter(buffer, [Case("x"), Case("y")]).timeout(consume=True)
    assert result.to_dict(cases=True)["matched_case"] is None
    assert (result.pattern, result.output, buffer.pending) == ("", "abc", "")


def test_eof_is_a_result_after_final_match_attempt() -> None:
    expecter = Expecter(ExpectBuffer(), [Case("done$"), Case("prompt")])
    assert expecter.feed(b"partial \xe2\x82") is None
    result = expecter.feed_eof()
    assert result is not None
    assert (result.matched, result.reason, result.output) == (False, "eof", "partial \ufffd")
    assert expecter.feed_eof() is None


def test_match_completed_by_eof_flush_wins_over_eof() -> None:
    expecter = Expecter(ExpectBuffer(), [Case("end\ufffd")])
    assert expecter.feed(b"the end\xe2\x82") is None  # incomplete char held by the decoder
    result = expecter.feed_eof()
    assert result is not None
    assert (result.reason, result.output) == ("match", "the end\ufffd")


def test_check_matches_text_buffered_before_the_expecter_existed() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"user@box:~$ ")
    expecter = Expecter(buffer, [Case(r"\$\s*$")])
    result = expecter.check()
    assert result is not None
    assert result.output == "user@box:~$ "
    assert expecter.done
    assert expecter.check() is None


def test_take_consumes_everything_pending() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"hello ")
    buffer.feed(b"world")
    assert buffer.take() == "hello world"
    assert buffer.pending == ""
    assert buffer.take() == ""


# --- decoding, ANSI, anchors --------------------------------------------------------------


def test_multibyte_char_split_across_feeds_is_matched_whole() -> None:
    expecter = Expecter(ExpectBuffer(), [Case("caf(é)!")])
    data = "café!".encode()
    assert expecter.feed(data[:4]) is None
    assert expecter.feed(data[4:5]) is None
    result = expecter.feed(data[5:])
    assert result is not None
    assert result.captures == ["café!", "é"]


def test_strip_ansi_option_matches_through_colour_codes() -> None:
    buffer = ExpectBuffer(strip_ansi=True)
    buffer.feed(b"\x1b[32mready\x1b[0m\r\n\x1b]0;t")
    buffer.feed(b"itle\x07$ ")
    result = buffer.match([Case(r"ready\n\$ $")])
    assert result is not None
    assert result.output == "ready\n$ "


def test_caret_matches_only_at_real_line_starts() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"a: b\nc")
    assert buffer.match([Case("a: ")]) is not None
    assert buffer.match([Case("^b")]) is None  # "b" follows ": ", not a newline
    result = buffer.match([Case("^c")])
    assert result is not None
    assert result.output == "b\nc"


def test_dollar_matches_at_end_of_buffer_and_before_newline() -> None:
    buffer = ExpectBuffer()
    buffer.feed(b"x $ \nuser$ ")
    result = buffer.match([Case(r"\$ $")])
    assert result is not None
    assert result.output == "x $ "


# --- buffer cap and efficiency ------------------------------------------------------------


def test_buffer_cap_drops_oldest_text_and_reports_it() -> None:
    buffer = ExpectBuffer(max_chars=10)
    buffer.feed(b"0123456789abcdef")
    assert buffer.pending == "6789abcdef"
    assert buffer.dropped == 6
    result = buffer.match([Case("f")])
    assert result is not None
    assert result.to_dict()["dropped_chars"] == 6
    buffer.feed(b"gh")
    again = buffer.match([Case("h")])
    assert again is not None
    assert again.dropped == 0


def test_waiting_through_a_large_flood_stays_fast() -> None:
    buffer = ExpectBuffer(max_chars=200_000)
    expecter = Expecter(buffer, [Case(r"DONE (\d+)"), Case(r"^FAIL$")])
    chunk = b"building target, compiling, linking...\n" * 1600  # ~62 KiB
    started = time.perf_counter()
    for _ in range(320):  # ~20 MiB
        assert expecter.feed(chunk) is None
    result = expecter.feed(b"DONE 42\n")
    elapsed = time.perf_counter() - started
    assert result is not None
    assert result.captures == ["DONE 42", "42"]
    assert buffer.dropped > 0
    assert elapsed < 3.0, f"flood took {elapsed:.2f}s"


def test_lookback_none_finds_match_spanning_many_feeds() -> None:
    cases = [Case(r"(?s)BEGIN.*END")]
    chunks = [b"BEGIN", *([b"x" * 100] * 50), b"END"]
    exact = run_chunks(cases, chunks, ExpectBuffer(lookback=None))
    assert exact is not None
    assert exact.output.startswith("BEGIN")
    assert exact.output.endswith("END")
    windowed = run_chunks(cases, chunks, ExpectBuffer(lookback=1000))
    assert windowed is not None
    assert windowed.reason == "eof"  # the documented trade-off of a short lookback


def test_new_cases_rescan_whole_pending_text() -> None:
    buffer = ExpectBuffer(lookback=0)
    buffer.feed(b"needle" + b"." * 100)
    assert buffer.match([Case("nothing")]) is None
    result = buffer.match([Case("needle")])
    assert result is not None
    assert result.output == "needle"


# --- chunking independence (property tests) -----------------------------------------------


def one_shot(cases: list[Case], data: bytes) -> Match | None:
    return run_chunks(cases, [data])


def key(result: Match | None) -> tuple[object, ...]:
    assert result is not None
    return (result.reason, result.output, result.captures, result.matched_case)


@given(small_text, st.text(alphabet="ab\n$é€ ", min_size=1, max_size=4), cuts_strategy)
def test_literal_match_is_independent_of_chunking(text: str, literal: str, cuts: list[int]) -> None:
    data = text.encode()
    cases = [Case(re.escape(literal))]
    assert key(run_chunks(cases, split_at(data, cuts))) == key(one_shot(cases, data))


@given(
    st.text(alphabet="ab1234.x", max_size=60),
    st.text(alphabet="abx", min_size=1, max_size=3),
    st.text(alphabet="abx", min_size=1, max_size=3),
    cuts_strategy,
)
def test_bounded_pattern_match_is_independent_of_chunking(
    text: str, before: str, after: str, cuts: list[int]
) -> None:
    # Digits between letter-only literals: the match cannot grow once its end has arrived.
    data = text.encode()
    cases = [Case(f"{re.escape(before)}([0-9]+)\\.?([0-9]*){re.escape(after)}")]
    assert key(run_chunks(cases, split_at(data, cuts))) == key(one_shot(cases, data))


@given(
    st.text(alphabet="abc", max_size=60),
    st.lists(st.text(alphabet="abc", min_size=3, max_size=3), min_size=1, max_size=4),
    cuts_strategy,
)
def test_earliest_case_wins_regardless_of_chunking(
    text: str, literals: list[str], cuts: list[int]
) -> None:
    # Equal-length literals: the earliest-starting occurrence is also the first complete one.
    data = text.encode()
    cases = [Case(re.escape(lit)) for lit in literals]
    result = run_chunks(cases, split_at(data, cuts))
    assert key(result) == key(one_shot(cases, data))
    starts = [(text.find(lit), i) for i, lit in enumerate(literals) if lit in text]
    if starts:
        start, index = min(starts)
        assert result is not None
        assert result.matched_case == index
        assert result.output == text[: start + 3]


@given(
    st.text(alphabet="abc", max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts_strategy,
)
def test_no_case_starts_earlier_within_consumed_output(
    text: str, literals: list[str], cuts: list[int]
) -> None:
    result = run_chunks([Case(re.escape(lit)) for lit in literals], split_at(text.encode(), cuts))
    assert result is not None
    if result.matched_case is None:
        assert not any(lit in text for lit in literals)
        return
    win_start = len(result.output) - len(result.captures[0])
    for i, lit in enumerate(literals):
        found = result.output.find(lit)
        if found != -1:
            assert (found, i) >= (win_start, result.matched_case)


@given(
    st.text(alphabet="abé", min_size=200, max_size=1500),
    st.text(alphabet="abé", min_size=1, max_size=4),
    st.integers(min_value=1, max_value=50),
    st.sampled_from([None, 3, 16]),
)
def test_repeated_expects_find_successive_occurrences(
    text: str, literal: str, chunk_size: int, lookback: int | None
) -> None:
    # Many consumptions exercise the store's compaction; a lookback of at least
    # len(literal) - 1 cannot miss a literal.
    buffer = ExpectBuffer(lookback=lookback)
    data = text.encode()
    outputs: list[str] = []
    for offset in range(0, len(data), chunk_size):
        buffer.feed(data[offset : offset + chunk_size])
        while (result := buffer.match([Case(re.escape(literal))])) is not None:
            outputs.append(result.output)
    expected: list[str] = []
    position = 0
    while (found := text.find(literal, position)) != -1:
        expected.append(text[position : found + len(literal)])
        position = found + len(literal)
    assert outputs == expected
    assert buffer.take() == text[position:]
