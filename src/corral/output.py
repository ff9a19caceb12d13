"""Sans-IO helpers for process and terminal output: decoding, ANSI stripping, capping.

Nothing here does I/O, starts threads or touches an event loop; callers feed bytes in
and take text or bytes out, so every piece can be tested deterministically.

* :class:`IncrementalDecoder` turns a byte stream into text without ever splitting a
  multi-byte UTF-8 character across two results; invalid bytes become U+FFFD.
* :func:`strip_ansi` / :class:`AnsiStripper` remove terminal escape sequences and
  control characters so that an agent (and a regex) sees plain text.
* :class:`HeadTailBuffer` stores a capped byte stream as "first half + last half", which
  is what an agent wants from a huge log: how it started and how it ended.
* :func:`cap_text` applies the same head + tail idea to a string.
"""

from __future__ import annotations

import codecs
import re

from corral.errors import ErrorCode, SandboxError

__all__ = [
    "AnsiStripper",
    "HeadTailBuffer",
    "IncrementalDecoder",
    "TerminalFilter",
    "cap_text",
    "for_terminal",
    "strip_ansi",
]


class IncrementalDecoder:
    """UTF-8 decoder for a chunked byte stream.

    A character split across two :meth:`feed` calls is held back until it is complete,
    so the concatenation of all results equals decoding the whole stream at once.
    Invalid bytes are replaced with U+FFFD rather than raising: sandboxed programs print
    arbitrary bytes and an agent must still see the rest of the output.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """Decode ``data``; an incomplete trailing character is kept for the next call."""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: emit what is held back (an incomplete character becomes U+FFFD)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


# One token of terminal noise. Alternatives are tried in order at each position:
#   CSI  ESC [ params intermediates final           (colours, cursor movement, ...)
#   string sequences OSC/DCS/SOS/PM/APC (ESC ] P X ^ _) ended by BEL or ST (ESC \);
#        an ESC that is not ST aborts the string, as in a real terminal, hence (?=\x1b)
#   any other ESC sequence: ESC intermediates final  (charset selection, keypad mode, ...)
#   a lone C0/C1 control character other than \t and \n; this includes \r (see strip_ansi)
_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\|(?=\x1b))"
    r"|\x1b[ -/]*[0-~]"
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)

# A proper prefix of a sequence that more input could still complete (or change). These are
# exactly the cases where _SEQUENCE's outcome at that position depends on text not seen yet.
_PARTIAL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*\x1b?|[ -/]*)\Z")

# An unterminated sequence is held back at most this many characters; past that it is
# treated as garbage (its ESC is dropped, the rest passes through) so memory stays bounded.
_MAX_HOLD = 4096


def strip_ansi(text: str) -> str:
    """Remove escape sequences and control characters, keeping ``\\n`` and ``\\t``.

    Every ``\\r`` is dropped: ``"\\r\\n"`` becomes ``"\\n"`` and a lone ``\\r`` (progress-bar
    redraws) simply disappears, so redrawn text is concatenated instead of inventing lines.
    A sequence cut off by the end of the text loses its ESC and the character after it;
    the rest of it stays as text.
    """
    return _SEQUENCE.sub("", text)


# SGR (colours, bold): the one CSI kept for a terminal; it moves nothing and reads nothing.
_SGR = re.compile(r"\x1b\[[0-9;:]*m\Z")


def for_terminal(text: str, *, colours: bool = True) -> str:
    """``text`` made safe to print to an operator's terminal.

    Keeps printable text, ``\n``, ``\t``, ``\r\n`` and (``colours``) SGR colour sequences;
    drops every other escape sequence (OSC such as clipboard writes (52) and window titles,
    DCS, APC, PM, SOS, cursor-moving and mode-setting CSI), lone ``\r``, and C0/C1 controls.
    The same grammar as :func:`strip_ansi`, so one parser decides what a sequence is.
    """

    return _SEQUENCE.sub(lambda token: _kept(token, text, colours), text)


def _kept(token: re.Match[str], text: str, colours: bool) -> str:
    seq = token.group()
    if colours and _SGR.match(seq):
        return seq
    if seq == "\r" and text.startswith("\n", token.end()):
        return seq
    return ""


class TerminalFilter:
    """Incremental :func:`for_terminal` over a byte stream (a command's live output).

    Bytes are decoded as UTF-8 (invalid bytes show as U+FFFD: this is for a terminal, never
    for a pipe), and a sequence or ``\r`` split across feeds is held until it is complete.
    """

    __slots__ = ("_colours", "_decoder", "_held")

    def __init__(self, *, colours: bool = True) -> None:
        self._decoder = IncrementalDecoder()
        self._held = ""
        self._colours = colours

    def feed(self, data: bytes) -> bytes:
        text = self._held + self._decoder.feed(data)
        partial = _PARTIAL.search(text, max(0, len(text) - _MAX_HOLD))
        stop = partial.start() if partial else len(text)
        if stop == len(text) and text.endswith("\r"):
            stop -= 1  # kept only if "\n" comes next
        self._held = text[stop:]
        pieces: list[str] = []
        last = 0
        for token in _SEQUENCE.finditer(text):
            if token.start() >= stop:
                break
            pieces.append(text[last : token.start()])
            pieces.append(_kept(token, text, self._colours))
            last = token.end()
        pieces.append(text[last:stop])
        return "".join(pieces).encode("utf-8")

    def flush(self) -> bytes:
        held, self._held = self._held + self._decoder.flush(), ""
        return for_terminal(held, colours=self._colours).encode("utf-8")


class AnsiStripper:
    """Incremental :func:`strip_ansi` that copes with sequences split across feeds.

    For any chunking, ``"".join(feed(c) for c in chunks) + flush()`` equals
    ``strip_ansi("".join(chunks))``, except when a single unterminated sequence grows past
    4096 characters, which is given up on rather than buffered forever.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        """Strip ``text``; an incomplete trailing escape sequence is held for the next feed."""
        data = self._held + text if self._held else text
        partial = _PARTIAL.search(data, max(0, len(data) - _MAX_HOLD))
        stop = partial.start() if partial else len(data)
        self._held = data[stop:]
        # Scan the whole of `data`, not data[:stop]: a string sequence aborted by the held ESC
        # ends via a lookahead that has to see that ESC. No token before `stop` reaches past it.
        pieces: list[str] = []
        last = 0
        for token in _SEQUENCE.finditer(data):
            if token.start() >= stop:
                break
            pieces.append(data[last : token.start()])
            last = token.end()
        pieces.append(data[last:stop])
        return "".join(pieces)

    def flush(self) -> str:
        """End of stream: strip and return whatever was held back."""
        held, self._held = self._held, ""
        return strip_ansi(held)


def _invalid(message: str) -> SandboxError:
    return SandboxError(message, code=ErrorCode.INVALID_INPUT)


class HeadTailBuffer:
    """A byte store capped at ``cap`` bytes: the first ``cap // 2`` and the latest rest.

    The head is a bytearray that stops growing; the tail is the chunks as they came, the
    oldest dropped whole once the newer ones hold the tail's share, so what is kept never
    exceeds the cap by more than one chunk and no append copies what is already held.
    Rendering decodes chunk by chunk into one growing string (a capture of a 64 MiB cap costs
    about 2x the cap at its peak, the text included: ``bench/bench_capture.py``; it was 4.5x,
    then 3x).
    """

    __slots__ = (
        "_cap",
        "_chunks",
        "_head",
        "_head_cap",
        "_skip",
        "_tail_cap",
        "_tail_len",
        "_total",
    )

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise _invalid(f"output cap must be >= 0 bytes, got {cap}")
        self._cap = cap
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = bytearray()
        self._chunks: list[bytes] = []
        self._skip = 0  # bytes at the start of the first chunk that are no longer held
        self._tail_len = 0  # bytes held in the chunks, after the skip
        self._total = 0

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def total(self) -> int:
        """Bytes ever appended."""
        return self._total

    @property
    def dropped(self) -> int:
        """Bytes appended but no longer held."""
        return max(0, self._total - self._cap)

    @property
    def truncated(self) -> bool:
        return self._total > self._cap

    @property
    def cut_at(self) -> int | None:
        """Where in :meth:`getvalue` the dropped middle was (the head's end), or None."""
        return len(self._head) if self.truncated else None

    def append(self, data: bytes) -> None:
        if not data:
            return
        self._total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            with memoryview(data) as view:
                self._head += view[:room]
            data = data[room:]
        if not data or self._tail_cap == 0:
            return
        self._chunks.append(bytes(data))
        self._tail_len += len(data)
        excess = self._tail_len - self._tail_cap
        while excess > 0:  # drop what is superseded: whole chunks, then the start of one
            first = len(self._chunks[0]) - self._skip
            if first <= excess:
                self._chunks.pop(0)
                self._skip = 0
                self._tail_len -= first
                excess -= first
            else:
                self._skip += excess
                self._tail_len -= excess
                excess = 0

    def _tail_view(self) -> bytes:
        if not self._chunks:
            return b""
        if len(self._chunks) == 1 and not self._skip:
            return self._chunks[0]
        with memoryview(self._chunks[0]) as first:
            return b"".join([first[self._skip :], *self._chunks[1:]])

    def getvalue(self) -> bytes:
        """Head followed by tail, with no marker in between."""
        if not self._head:
            return self._tail_view()
        return b"".join([self._head, self._tail_view()])

    def render(self) -> str:
        """Decode for display; when bytes were dropped a marker line says how many.

        The text is grown by appending to one string, chunk by chunk (CPython extends a
        string nothing else holds in place), so the peak is the kept bytes plus the text,
        not a joined copy of either."""
        if not self._chunks and not self.truncated:  # all of it in the head: most commands
            return self._head.decode("utf-8", "replace")
        head = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = head.decode(self._head)
        views = [memoryview(c) for c in self._chunks]
        if views and self._skip:
            views[0] = views[0][self._skip :]
        tail = head
        if self.truncated:
            # Characters cut by the gap would decode to U+FFFD noise: an incomplete
            # character at the end of the head stays in its decoder, and continuation bytes
            # at the start of the tail are skipped.
            text += f"\n[... {self.dropped} bytes truncated ...]\n"
            tail = codecs.getincrementaldecoder("utf-8")(errors="replace")
            views = _skip_continuation(views)
        for view in views:
            text += tail.decode(view)
        text += tail.decode(b"", True)
        return text

    def read_since(self, offset: int) -> tuple[bytes, int, bool]:
        """Bytes appended at or after absolute ``offset`` that are still held.

        Returns ``(data, new_offset, lost)``: ``new_offset`` is :attr:`total` (pass it back
        next time) and ``lost`` says whether some bytes at or after ``offset`` were dropped
        (so the caller can tell the agent that its incremental view has a gap).
        """
        if not 0 <= offset <= self._total:
            raise _invalid(f"read offset {offset} is outside 0..{self._total}")
        tail = self._tail_view()
        head_len = len(self._head)
        tail_start = self._total - len(tail)
        data = bytes(self._head[offset:]) if offset < head_len else b""
        data += tail[max(0, offset - tail_start) :]
        lost = max(offset, head_len) < tail_start
        return data, self._total, lost


def _skip_continuation(views: list[memoryview]) -> list[memoryview]:
    """``views`` without the UTF-8 continuation bytes (at most 3) they start with."""
    skipped = 0
    while views and skipped < 3:
        if not views[0]:
            views.pop(0)
            continue
        if not 0x80 <= views[0][0] <= 0xBF:
            break
        views[0] = views[0][1:]
        skipped += 1
    return views


def cap_text(text: str, limit_chars: int) -> tuple[str, bool]:
    """Keep the first ``limit_chars // 2`` and the last remaining characters of ``text``.

    Returns ``(text, truncated)``. When truncated, a marker line naming the number of
    characters cut sits between head and tail; the marker is not counted in the limit, so
    the result is at most ``limit_chars`` plus about 40 characters.
    """
    if limit_chars < 0:
        raise _invalid(f"character limit must be >= 0, got {limit_chars}")
    if len(text) <= limit_chars:
        return text, False
    head = limit_chars // 2
    tail = limit_chars - head
    cut = len(text) - limit_chars
    tail_text = text[len(text) - tail :] if tail else ""
    return f"{text[:head]}\n[... {cut} chars truncated ...]\n{tail_text}", True


def text_bytes(data: str | bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """``data`` as bytes: text as UTF-8, its lone surrogates (how Python and corral's API
    spell bytes that are not UTF-8, ``"caf\\udce9"``) back to those bytes; a surrogate that
    stands for no byte is an ``invalid_input`` error, not a crash."""
    if not isinstance(data, str):
        return data  # bytes as they are (a memoryview too: not copied)
    try:
        return data.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise SandboxError(
            f"text with {data[exc.start : exc.end]!r} at {exc.start} cannot be written: a lone "
            "surrogate stands for a byte only from \\udc80 to \\udcff; send bytes instead",
            code=ErrorCode.INVALID_INPUT,
        ) from None
