"""The byte stream of a command's output over HTTP: ``corral serve``'s exec responses.

A response body (``application/vnd.corral.frames``) is a sequence of frames, each a 5-byte
head (kind: 1 byte, length: 4 bytes big-endian) and that many bytes:

========  ==========================================================================
kind      body
========  ==========================================================================
``1``     stdout bytes, as the command wrote them
``2``     stderr bytes
``3``     a note for the user's stderr (UTF-8 text: a warning, a refusal, a timeout)
``4``     the end: a JSON object (``exit_code``, ``timed_out``, ``ended``, ...)
``5``     an error instead of an end: ``{"error": {"code", "message", "retryable"}}``
========  ==========================================================================

Output is bytes, never decoded: binary output crosses byte for byte. Stdlib only, so the
CLI's fast path imports nothing heavy.
"""

from __future__ import annotations

from _struct import Struct

TYPE_CHECKING = False  # no typing at run time: the CLI's start pays for every import
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import IO, Any

__all__ = [
    "END",
    "ERROR",
    "MEDIA_TYPE",
    "NOTE",
    "STDERR",
    "STDOUT",
    "FrameReader",
    "frame",
    "json_frame",
]

MEDIA_TYPE = "application/vnd.corral.frames"
STDOUT, STDERR, NOTE, END, ERROR = 1, 2, 3, 4, 5
_HEAD = Struct(">BI")
MAX_FRAME = 16 << 20


def frame(kind: int, data: bytes) -> bytes:
    return _HEAD.pack(kind, len(data)) + data


def json_frame(kind: int, obj: Any) -> bytes:
    import json  # the server's; the CLI reads frames only, without json (client.fast)

    return frame(kind, json.dumps(obj).encode())


class FrameReader:
    """Frames from a blocking byte stream (``http.client.HTTPResponse`` or a file)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream

    def _exactly(self, n: int) -> bytes:
        parts: list[bytes] = []
        while n:
            piece = self.stream.read(n)
            if not piece:
                raise EOFError("the server's stream ended mid-frame")
            parts.append(piece)
            n -= len(piece)
        return b"".join(parts)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        while True:
            head = self.stream.read(_HEAD.size)
            if not head:
                return
            if len(head) < _HEAD.size:
                head += self._exactly(_HEAD.size - len(head))
            kind, length = _HEAD.unpack(head)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes is over the {MAX_FRAME} limit")
            yield kind, self._exactly(length) if length else b""


def split_frames(buffer: bytearray) -> Iterator[tuple[int, bytes]]:
    """Whole frames off the front of ``buffer`` (what is left stays for the next call)."""
    while len(buffer) >= _HEAD.size:
        kind, length = _HEAD.unpack_from(buffer)
        if length > MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes is over the {MAX_FRAME} limit")
        if len(buffer) < _HEAD.size + length:
            return
        data = bytes(buffer[_HEAD.size : _HEAD.size + length])
        del buffer[: _HEAD.size + length]
        yield kind, data
