"""The framed-message protocol between the host and the guest agent (stdlib only).

This module is imported by both sides: by the host library as ``corral.agent.protocol`` and
by the guest agent, inside the box, as a sibling module. It must therefore stay stdlib-only
and cheap to import.

A frame is an 8-byte header, a JSON object and an optional binary payload::

    u32 big-endian  length of the JSON header (1 .. MAX_HEADER)
    u32 big-endian  length of the payload     (0 .. MAX_PAYLOAD)
    JSON header     UTF-8 object
    payload         raw bytes (process output, stdin data, file contents)

Raw payloads keep output and file data out of JSON, so no base64 on the hot path.

Requests carry ``"op"`` and an integer ``"id"``; the agent answers each with exactly one reply
``{"re": id, ...}`` (or ``{"re": id, "error": {"code": ..., "message": ...}}``). Events the
agent sends on its own carry ``"ev"``: ``ready``, ``out`` (payload = bytes of ``stream`` of
``pid``) and ``exit``.

The host treats every frame as hostile: lengths are bounded before anything is allocated and
the JSON must be an object.
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False  # the guest agent does not import typing (see agent.py)
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct(">II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 16 << 20

VM_SNAPSHOT_MARKER = b"corral-snapshot-point\n"
"""What a microVM's agent writes on its channel once it is up with every import done, before
anything box-specific: the host may save the VM there, then sends ``<size>\\n`` and a JSON
object of that size: ``script`` (the box's mounts), ``config`` (the agent's) and ``clock``."""

# Operations the agent understands; one message type per thing the host can ask.
OPS = frozenset(
    {
        "spawn",
        "write",
        "close_stdin",
        "signal",
        "resize",
        "stats",
        "info",
        "file_read",
        "file_write",
        "file_list",
        "file_stat",
        "file_mkdir",
        "file_remove",
        "shutdown",
        "ping",
    }
)


class FrameError(Exception):
    """A frame that breaks the protocol (too long, not JSON, not an object)."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Serialise one frame."""
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER:
        raise FrameError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(len(body), len(payload)) + body + payload


def parse_lengths(prefix: bytes) -> tuple[int, int]:
    """Validate the 8-byte prefix and return (header length, payload length)."""
    hlen, plen = HEADER.unpack(prefix)
    if not 1 <= hlen <= MAX_HEADER:
        raise FrameError(f"header length {hlen} out of range")
    if plen > MAX_PAYLOAD:
        raise FrameError(f"payload length {plen} out of range")
    return hlen, plen


def parse_header(raw: bytes) -> dict[str, Any]:
    """Decode the JSON header; anything but an object is a protocol error."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"header is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FrameError("header is not a JSON object")
    return value


class FrameDecoder:
    """Incremental, sans-IO frame splitter: feed bytes, get complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self._buf += data
        frames: list[tuple[dict[str, Any], bytes]] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER.size:
                    return frames
                self._need = parse_lengths(bytes(self._buf[: HEADER.size]))
                del self._buf[: HEADER.size]
            hlen, plen = self._need
            if len(self._buf) < hlen + plen:
                return frames
            header = parse_header(bytes(self._buf[:hlen]))
            payload = bytes(self._buf[hlen : hlen + plen])
            del self._buf[: hlen + plen]
            self._need = None
            frames.append((header, payload))
