"""Sans-IO expect engine for interactive PTY sessions (shell_expect / _cases / shell_batch).

The I/O driver owns one :class:`ExpectBuffer` per session and feeds it every chunk read
from the PTY. To wait for output it builds an :class:`Expecter` over some :class:`Case`\\ s,
calls :meth:`Expecter.check` once (the answer may already be buffered) and then
:meth:`Expecter.feed` per chunk until a :class:`Match` comes back; timeouts and EOF are
results (``matched=False``), never exceptions.

Matching rules:

* Patterns are Python :mod:`re` regexes over decoded text, compiled with ``re.MULTILINE``:
  ``$`` matches before any newline *and* at the end of the buffered text, so ``\\$\\s*$``
  matches a shell prompt that is the last thing printed. ``^`` matches only at a real line
  start of the stream, not merely where the previous match ended.
* Among several cases the match that *starts* earliest in the text buffered so far wins;
  ties go to the case listed first. As in every expect, this is decided on what has
  arrived: a longer case that would have started earlier but is not complete yet loses.
* On a match everything up to and including the match end is consumed and returned as
  ``output``. Timeout and EOF results report the pending text without consuming it
  (unless asked), so a prompt that arrives late can still be matched by the next expect.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.errors import ErrorCode, ProtocolError, SandboxError
from corral.output import AnsiStripper, IncrementalDecoder

__all__ = ["Case", "ExpectBuffer", "Expecter", "Match", "expand_response"]

# `$$`, `${N}` or `$N` with a single digit N (as in the shell: `$10` is `$1` then "0").
_REFERENCE = re.compile(r"\$(?:(\$)|\{(\d+)\}|(\d))")

# Characters before the search start that a regex may look at, for `^`, `\b` and lookbehinds.
_CONTEXT = 256


def _invalid(message: str) -> SandboxError:
    return SandboxError(message, code=ErrorCode.INVALID_INPUT)


def expand_response(template: str, captures: Sequence[str]) -> str:
    """Replace ``$1``, ``${12}`` with captures (``$0`` is the whole match); ``$$`` is ``$``.

    A ``$`` not followed by a digit, ``{`` or ``$`` stays literal, so ``echo $HOME`` is safe.
    A reference to a group that does not exist raises ``SandboxError(INVALID_INPUT)``.
    """

    def substitute(ref: re.Match[str]) -> str:
        if ref.group(1):
            return "$"
        index = int(ref.group(2) or ref.group(3))
        if index >= len(captures):
            raise _invalid(
                f"response {template!r} refers to ${index} but only {len(captures) - 1} "
                "capture group(s) exist; write $$ for a literal $"
            )
        return captures[index]

    return _REFERENCE.sub(substitute, template)


@dataclass(frozen=True, slots=True)
class Case:
    """One alternative to wait for; ``respond`` is text to send back when it matches."""

    pattern: str
    tag: str | None = None
    label: str | None = None
    respond: str | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise _invalid(f"expect pattern must be a string, got {type(self.pattern).__name__}")
        try:
            with warnings.catch_warnings():
                # "Possible nested set" and the like: a pattern from a model is still valid,
                # and a warning (an exception under -W error) must not escape as a crash.
                warnings.simplefilter("ignore", FutureWarning)
                regex = re.compile(self.pattern, re.MULTILINE)
        except re.error as exc:
            raise _invalid(f"invalid expect pattern {self.pattern!r}: {exc}") from None
        if self.respond is not None:
            # Check group references now, while the caller can still be told, not after a
            # match has consumed output and the response can no longer be sent correctly.
            expand_response(self.respond, [""] * (regex.groups + 1))
        object.__setattr__(self, "regex", regex)


@dataclass(frozen=True, slots=True)
class Match:
    """Outcome of an expect: a match, or a timeout/EOF with the output seen so far."""

    matched: bool
    pattern: str
    output: str
    captures: list[str]
    matched_case: int | None
    tag: str | None
    label: str | None
    respond: str | None
    reason: Literal["match", "timeout", "eof"]
    dropped: int = 0  # chars lost from the front of `output` because the buffer was full

    def to_dict(self, *, cases: bool = False) -> dict[str, Any]:
        """The tool JSON: shell_expect's shape, plus the case fields when ``cases``.

        ``reason`` is present only when ``matched`` is false, ``dropped_chars`` only when
        the buffer overflowed and the start of ``output`` was lost.
        """
        result: dict[str, Any] = {
            "matched": self.matched,
            "pattern": self.pattern,
            "output": self.output,
            "captures": list(self.captures),
        }
        if cases:
            result.update(matched_case=self.matched_case, tag=self.tag, label=self.label)
        if not self.matched:
            result["reason"] = self.reason
        if self.dropped:
            result["dropped_chars"] = self.dropped
        return result


class ExpectBuffer:
    """Per-session accumulator of decoded PTY output that cases are matched against.

    Text is kept in an in-memory ``StringIO`` (amortised O(1) appends, O(k) slices) with
    consumed text cut off lazily. When pending text exceeds ``max_chars`` the oldest part
    is dropped and counted, so a flood cannot exhaust memory.

    Rescanning trade-off: after a failed search, the next search with the same cases starts
    ``lookback`` characters before where the previous one ended instead of at the start of
    the pending text, so waiting on a flood stays linear. A match that begins more than
    ``lookback`` characters before the end of the text already searched, and only completes
    with new data, can therefore be missed (or found at a later start). ``lookback=None``
    always rescans everything (exact, quadratic in the worst case). A new set of cases
    always searches all pending text.
    """

    __slots__ = (
        "_decoder",
        "_dropped",
        "_end",
        "_eof",
        "_lookback",
        "_max_chars",
        "_scan_key",
        "_scanned",
        "_start",
        "_store",
        "_stripper",
        "_unreported",
    )

    def __init__(
        self, max_chars: int = 1_000_000, strip_ansi: bool = False, *, lookback: int | None = 65_536
    ) -> None:
        if max_chars < 1:
            raise _invalid(f"expect buffer size must be >= 1 char, got {max_chars}")
        if lookback is not None and lookback < 0:
            raise _invalid(f"lookback must be >= 0 or None, got {lookback}")
        self._max_chars = max_chars
        self._lookback = lookback
        self._decoder = IncrementalDecoder()
        self._stripper = AnsiStripper() if strip_ansi else None
        self._store = io.StringIO()
        self._start = 0  # index in _store of the first pending char; text before is context
        self._end = 0  # length of _store
        self._eof = False
        self._dropped = 0  # chars ever dropped for lack of room
        self._unreported = 0  # chars dropped since the last consumption
        self._scan_key: tuple[Case, ...] | None = None
        self._scanned = 0  # pending chars already searched in vain with _scan_key

    @property
    def pending(self) -> str:
        """Unconsumed text (not consumed by reading it)."""
        return self._slice(self._start, self._end)

    @property
    def dropped(self) -> int:
        """Characters ever dropped because pending text exceeded ``max_chars``."""
        return self._dropped

    @property
    def eof(self) -> bool:
        return self._eof

    def feed(self, data: bytes) -> None:
        if self._eof:
            raise ProtocolError("expect buffer was fed data after end of stream")
        text = self._decoder.feed(data)
        self._append(self._stripper.feed(text) if self._stripper else text)

    def feed_eof(self) -> None:
        """End of stream: flush partial characters or sequences; later feeds are errors."""
        if self._eof:
            return
        text = self._decoder.flush()
        if self._stripper:
            text = self._stripper.feed(text) + self._stripper.flush()
        self._append(text)
        self._eof = True

    def match(self, cases: Sequence[Case]) -> Match | None:
        """Search pending text; on a match consume through its end and return it."""
        key = tuple(cases)
        if key != self._scan_key:
            self._scan_key, self._scanned = key, 0
        begin = 0 if self._lookback is None else max(0, self._scanned - self._lookback)
        origin = max(0, self._start + begin - _CONTEXT)
        window = self._slice(origin, self._end)
        pos = self._start + begin - origin
        best: tuple[int, re.Match[str]] | None = None
        for index, case in enumerate(key):
            found = case.regex.search(window, pos)
            if found and (best is None or found.start() < best[1].start()):
                best = (index, found)
        if best is None:
            self._scanned = self._end - self._start
            return None
        index, found = best
        case = key[index]
        dropped = self._unreported
        output = self._consume(origin + found.end() - self._start)
        captures = [found.group(0), *found.groups("")]
        respond = None if case.respond is None else expand_response(case.respond, captures)
        return Match(
            matched=True, pattern=case.pattern, output=output, captures=captures,
            matched_case=index, tag=case.tag, label=case.label, respond=respond,
            reason="match", dropped=dropped,
        )  # fmt: skip

    def take(self) -> str:
        """Consume and return all pending text (a non-blocking read)."""
        return self._consume(self._end - self._start)

    def timeout_result(self, cases: Sequence[Case], *, consume: bool = False) -> Match:
        """The unmatched result for a timeout; pending text is kept unless ``consume``."""
        return self._unmatched(cases, "timeout", consume)

    def eof_result(self, cases: Sequence[Case], *, consume: bool = False) -> Match:
        """The unmatched result at end of stream; pending text is kept unless ``consume``."""
        return self._unmatched(cases, "eof", consume)

    def _unmatched(
        self, cases: Sequence[Case], reason: Literal["timeout", "eof"], consume: bool
    ) -> Match:
        dropped = self._unreported
        output = self.take() if consume else self.pending
        # With several cases no single pattern applies; "" keeps the field a string.
        pattern = cases[0].pattern if len(cases) == 1 else ""
        return Match(False, pattern, output, [], None, None, None, None, reason, dropped)

    def _slice(self, begin: int, end: int) -> str:
        self._store.seek(begin)
        text = self._store.read(end - begin)
        self._store.seek(self._end)  # writes always go to the end
        return text

    def _append(self, text: str) -> None:
        if not text:
            return
        self._store.write(text)
        self._end += len(text)
        excess = self._end - self._start - self._max_chars
        if excess > 0:
            self._advance(excess)
            self._dropped += excess
            self._unreported += excess

    def _consume(self, count: int) -> str:
        text = self._slice(self._start, self._start + count)
        self._advance(count)
        self._unreported = 0
        # What follows a match was not necessarily searched: the next search starts afresh.
        self._scanned = 0
        return text

    def _advance(self, count: int) -> None:
        self._start += count
        self._scanned = max(0, self._scanned - count)
        # Compact once dead text outweighs live text, keeping some context: amortised O(1).
        if self._start > _CONTEXT and self._start - _CONTEXT > self._end - self._start:
            keep = self._slice(self._start - _CONTEXT, self._end)
            self._store = io.StringIO()
            self._store.write(keep)
            self._start, self._end = _CONTEXT, len(keep)


class Expecter:
    """Step function for one expect call over a session's :class:`ExpectBuffer`.

    Produces at most one result: after it, :meth:`check`, :meth:`feed` and
    :meth:`feed_eof` return ``None`` (data fed is still buffered for the next expect).
    """

    __slots__ = ("_buffer", "_cases", "_result")

    def __init__(self, buffer: ExpectBuffer, cases: Sequence[Case]) -> None:
        if not cases:
            raise _invalid("expect needs at least one pattern")
        self._buffer = buffer
        self._cases = tuple(cases)
        self._result: Match | None = None

    @property
    def result(self) -> Match | None:
        return self._result

    @property
    def done(self) -> bool:
        return self._result is not None

    def check(self) -> Match | None:
        """Match against what is buffered; at end of stream, give the EOF result."""
        if self._result is not None:
            return None
        result = self._buffer.match(self._cases)
        if result is None and self._buffer.eof:
            result = self._buffer.eof_result(self._cases)
        self._result = result
        return result

    def feed(self, data: bytes) -> Match | None:
        """Feed a chunk read from the PTY and return the result if this completes it."""
        self._buffer.feed(data)
        return self.check()

    def feed_eof(self) -> Match | None:
        """The PTY closed: returns a final match or the EOF result (None if already done)."""
        self._buffer.feed_eof()
        return self.check()

    def timeout(self, *, consume: bool = False) -> Match:
        """The deadline passed: the timeout result, or the result already reached."""
        if self._result is None:
            self._result = self._buffer.timeout_result(self._cases, consume=consume)
        return self._result
