"""The protocol between the host and the guest agent: frames, every message, every error code.

Stdlib only and cheap to import: the host imports it as ``corral.agent.protocol``, the guest
agent, inside the box, as a sibling module. The message types are ``TypedDict``s seen by the
type checker only (the agent never imports ``typing``); what is checked at run time is the
table of fields below (:data:`REQUESTS`, :data:`REPLIES`, :data:`EVENTS`), which a test holds
equal to the ``TypedDict``s.

A frame is an 8-byte header, a JSON object and an optional binary payload::

    u32 big-endian  length of the JSON header (1 .. MAX_HEADER)
    u32 big-endian  length of the payload     (0 .. MAX_PAYLOAD)
    JSON header     UTF-8 object
    payload         raw bytes (process output, stdin data, file contents)

Raw payloads keep output and file data out of JSON, so no base64 on the hot path.

Requests carry ``"op"`` and an integer ``"id"``; the agent answers each with exactly one reply
``{"re": id, ...}`` or ``{"re": id, "error": {"code": ErrorCode.*, "message": ...}}``. Events the
agent sends on its own carry ``"ev"``: ``ready``, ``out`` (payload = bytes of ``stream`` of
``pid``) and ``exit``.

The host treats every frame as hostile (:func:`check_event`, :func:`check_reply`,
:func:`reply_error`): lengths are bounded before anything is allocated, the JSON must be an
object, and every field must have its type. The agent checks requests the same way
(:func:`check_request`) and answers a bad one with ``protocol_error``.
"""

from __future__ import annotations

# struct's C half: struct.py itself is 0.46 M instructions of every agent's start to "ready"
from _struct import Struct

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any, Literal, NotRequired, TypedDict

    from corral.agent import lean
elif __package__:  # the host: corral.agent.protocol
    from corral.agent import lean
else:  # the guest agent: a sibling module (json's import costs the agent's start ~6 ms)
    import lean

HEADER = Struct(">II")
MAX_HEADER = 16 << 20
"""Room for a command line as long as a kernel takes (ARG_MAX: a quarter of the stack limit,
2 MiB by default, more with a larger stack) after JSON's escaping, with its environment."""
MAX_PAYLOAD = 16 << 20
"""Per frame; larger data goes in several frames (stdin in ``write`` chunks, files in
``file_read``/``file_write`` ranges)."""
PIECES_OVER = 1 << 20
"""A payload larger than this reaches the host's caller as :class:`Pieces` (a file read)."""

VM_SNAPSHOT_MARKER = b"corral-snapshot-point\n"
"""What a microVM's agent writes on its channel once it is up with every import done, before
anything box-specific: the host may save the VM there, then sends ``<size>\\n`` and a JSON
object of that size: ``script`` (the box's mounts), ``config`` (the agent's) and ``clock``."""
VM_REFUSED = "corral-init: refused: "
"""How a microVM's init starts its console line when it refuses the box's own layout (a
mask is not where it must be: a link swapped in by another box on the workspace): the box's
doing, not the VM's, so the host neither boots again nor drops the saved VM it restored. (A
mount that failed is not one of these: a VM restored from a damaged file could cause it.)"""


class ErrorCode:
    """Every error code the agent sends. The host maps each to one :mod:`corral.errors` class
    (``corral.channel``); a code not listed here is a protocol error."""

    PROTOCOL_ERROR = "protocol_error"
    """The request breaks the protocol: unknown operation, a missing or mistyped field."""
    INVALID_INPUT = "invalid_input"
    """A well-formed request the agent cannot do (write to a closed stdin, resize no PTY)."""
    PROCESS_NOT_FOUND = "process_not_found"
    SPAWN_FAILED = "spawn_failed"
    """The command could not start for a reason other than the two below (its working
    directory is missing, a resource limit)."""
    COMMAND_NOT_FOUND = "command_not_found"
    """The program does not exist (on PATH, or at the path given)."""
    NOT_EXECUTABLE = "not_executable"
    """The program exists but cannot be executed (no x permission, a directory, a format
    the kernel does not run)."""
    FILE_NOT_FOUND = "file_not_found"
    PERMISSION_DENIED = "permission_denied"
    PATH_OUTSIDE_SANDBOX = "path_outside_sandbox"
    FILE_TOO_LARGE = "file_too_large"
    IS_A_DIRECTORY = "is_a_directory"
    """A file operation met a directory where it needs a file."""
    NOT_A_DIRECTORY = "not_a_directory"
    """A file operation met a file where it needs a directory."""
    FILE_ERROR = "file_error"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    """read/write of a FIFO, socket or device node: refused, never opened for I/O (a FIFO
    a command left would block the agent; a device node is not the file it seems)."""
    AGENT_ERROR = "agent_error"
    """A bug in the agent: this request failed, the agent serves on."""


ERROR_CODES = frozenset(v for k, v in vars(ErrorCode).items() if k.isupper())
STREAMS = frozenset({"stdout", "stderr", "pty"})
FILE_TYPES = frozenset({"file", "dir", "symlink", "other"})
STDIN_MODES = frozenset({"null", "data", "pipe"})

# ---- every message: (field -> kind), checked at run time ------------------------------------
# Kinds: "int" (not bool), "number" (int or float), "str", "bool", "str|null", "[str]",
# "{str}" (object of str), "{int}" (object of int), "{}" (any object), "[entry]" (file_list).
# A leading "?" marks a field that may be absent.

REQUESTS: dict[str, dict[str, str]] = {
    "spawn": {
        "argv": "[str]",
        "env": "?{str}",
        "cwd": "?str|null",
        "stdin": "?str",
        "rlimits": "?{int}",
        "pty": "?bool",
        "rows": "?int",
        "cols": "?int",
    },
    "write": {"pid": "int", "eof": "?bool"},
    "close_stdin": {"pid": "int"},
    "flow": {"pid": "int", "hold": "bool"},
    "signal": {"pid": "int", "signal": "int", "group": "?bool"},
    "terminate": {"pid": "int", "grace": "number"},
    "resize": {"pid": "int", "rows": "int", "cols": "int"},
    "stats": {"pid": "int"},
    "info": {},
    "ping": {},
    "shutdown": {},
    "file_read": {"root": "str", "path": "str", "offset": "?int", "limit": "?int"},
    "file_write": {
        "root": "str",
        "path": "str",
        "append": "?bool",
        "parents": "?bool",
        "perm": "?int",
    },
    "file_list": {"root": "str", "path": "str"},
    "file_stat": {"root": "str", "path": "str"},
    "file_mkdir": {"root": "str", "path": "str", "parents": "?bool"},
    "file_remove": {"root": "str", "path": "str", "recursive": "?bool"},
    "publish": {"port": "int", "unix": "str"},
}
"""Every operation the host may ask for, and its fields (besides ``op`` and ``id``)."""

OPS = frozenset(REQUESTS)

_DONE = {"ok": "?bool"}
REPLIES: dict[str, dict[str, str]] = {
    "spawn": {"pid": "int"},
    "write": _DONE,
    "close_stdin": _DONE,
    "flow": _DONE,
    "signal": {"delivered": "bool"},
    "terminate": {"delivered": "bool"},
    "resize": _DONE,
    "stats": {"cpu_seconds": "number", "rss_bytes": "int", "state": "str", "processes": "int"},
    "info": {
        "kernel": "str",
        "hostname": "str",
        "arch": "str",
        "cpus": "int",
        "memory_bytes": "int",
        "agent_pid": "int",
        "python": "str",
        "sandbox_id": "?str",
        "workdir": "?str",
        "landlock": "?{}",
    },
    "ping": {},
    "shutdown": _DONE,
    "file_read": {"size": "int", "offset": "int", "eof": "bool", "dev": "?int", "ino": "?int"},
    "file_write": {"size": "int", "dev": "?int", "ino": "?int"},
    "file_list": {"entries": "[entry]", "truncated": "bool"},
    "file_stat": {
        "exists": "bool",
        "name": "?str",
        "type": "?str",
        "size": "?int",
        "mode": "?int",
        "mtime": "?number",
    },
    "file_mkdir": _DONE,
    "file_remove": _DONE,
    "publish": _DONE,
}
"""The successful reply to each operation (besides ``re``; a reply may carry more fields)."""

EVENTS: dict[str, dict[str, str]] = {
    "ready": {"pid": "int"},
    "out": {"pid": "int", "stream": "str"},
    "exit": {
        "pid": "int",
        "exit_code": "int",
        "signal": "?int",
        "duration": "?number",
        "cpu_seconds": "?number",
        "max_rss_bytes": "?int",
        "box": "?{int}",
    },
}
"""What the agent sends on its own: ``ready`` once, ``out`` (with the bytes as payload), ``exit``
once per process, after its last ``out``."""

ENTRY: dict[str, str] = {
    "name": "str",
    "type": "str",
    "size": "int",
    "mode": "int",
    "mtime": "number",
}
"""One entry of a ``file_list`` reply."""


class FrameError(Exception):
    """A frame that breaks the protocol (too long, not JSON, not an object, a bad field)."""


def _is(value: object, kind: str) -> bool:
    t = type(value)
    if kind == "int":
        return t is int
    if kind == "number":
        return t is int or t is float
    if kind == "str":
        return t is str
    if kind == "bool":
        return t is bool
    if kind == "str|null":
        return value is None or t is str
    if kind == "[str]":
        return isinstance(value, list) and all(type(v) is str for v in value)
    if kind == "{str}":
        return isinstance(value, dict) and all(type(v) is str for v in value.values())
    if kind == "{int}":
        return isinstance(value, dict) and all(type(v) is int for v in value.values())
    if kind == "{}":
        return isinstance(value, dict)
    if kind == "[entry]":
        return isinstance(value, list) and all(_entry_ok(v) for v in value)
    raise AssertionError(f"unknown kind {kind!r}")


def _entry_ok(value: object) -> bool:
    if not isinstance(value, dict):
        return False
    return not check_fields(value, ENTRY) and value["type"] in FILE_TYPES


def check_fields(message: dict[str, Any], fields: dict[str, str]) -> str | None:
    """What is wrong with ``message`` against ``fields`` (a sentence), or None."""
    for name, kind in fields.items():
        if name not in message:
            if kind[0] == "?":
                continue
            return f"no {name!r}"
        if not _is(message[name], kind.lstrip("?")):
            return f"a bad {name!r}: {message[name]!r:.80}"
    return None


def check_request(header: dict[str, Any]) -> str:
    """The agent's check of a request: its operation, or :class:`FrameError` saying why not."""
    op = header.get("op")
    fields = REQUESTS.get(op) if isinstance(op, str) else None
    if fields is None or not isinstance(op, str):
        raise FrameError(f"unknown operation {op!r}")
    problem = check_fields(header, fields)
    if problem is not None:
        raise FrameError(f"request {op!r} has {problem}")
    if op == "spawn" and not header["argv"]:
        raise FrameError("request 'spawn' has an empty 'argv'")
    return op


def check_event(header: dict[str, Any]) -> str:
    """The host's check of an event: its name, or :class:`FrameError` saying why not."""
    ev = header.get("ev")
    fields = EVENTS.get(ev) if isinstance(ev, str) else None
    if fields is None or not isinstance(ev, str):
        raise FrameError(f"unknown event {ev!r}")
    problem = check_fields(header, fields)
    if problem is not None:
        raise FrameError(f"event {ev!r} has {problem}")
    if ev == "out" and header["stream"] not in STREAMS:
        raise FrameError(f"unknown stream {header['stream']!r}")
    return ev


def check_reply(op: str, header: dict[str, Any]) -> None:
    """The host's check of a successful reply to ``op``: :class:`FrameError` if it is not one."""
    problem = check_fields(header, REPLIES[op])
    if problem is None and op == "file_stat" and header.get("type", "file") not in FILE_TYPES:
        problem = f"an unknown file type {header['type']!r:.40}"
    if problem is not None:
        raise FrameError(f"reply to {op!r} has {problem}")


def reply_error(header: dict[str, Any]) -> tuple[str, str] | None:
    """``(code, message)`` of an error reply, None for a success. A malformed error (not an
    object, an unknown code) is a ``protocol_error`` of that request only; messages are cut
    to 2000 characters."""
    if "error" not in header:
        return None
    err = header["error"]
    if type(err) is not dict:
        return ErrorCode.PROTOCOL_ERROR, "the agent sent a malformed error reply"
    code, message = err.get("code"), err.get("message")
    if type(message) is not str:
        message = "unknown error"
    if type(code) is not str or code not in ERROR_CODES:
        return ErrorCode.PROTOCOL_ERROR, f"the agent sent an unknown error code {code!r:.40}"
    return code, message[:2000]


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """Serialise one frame."""
    return encode_head(header, len(payload)) + payload


def encode_head(header: dict[str, Any], payload_size: int) -> bytes:
    """One frame's bytes before its payload (the length prefix and the header)."""
    body = lean.dumps(header).encode()
    if len(body) > MAX_HEADER:
        raise FrameError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if payload_size > MAX_PAYLOAD:
        raise FrameError(f"payload of {payload_size} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(len(body), payload_size) + body


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
        value = lean.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"header is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FrameError("header is not a JSON object")
    return value


class FrameDecoder:
    """Incremental, sans-IO frame splitter: feed bytes, get complete frames.

    What is fed is kept as the pieces it came in: a frame's payload is joined from them
    once (a 15 MiB file read arrives in 1 MiB reads), never grown in a buffer and copied
    out again."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._start = 0  # bytes of the first piece already taken
        self._have = 0  # bytes not yet taken
        self._need: tuple[int, int] | None = None

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        return self.feed_pieces(data, None)  # type: ignore[return-value]

    def feed_pieces(
        self, data: bytes, over: int | None = PIECES_OVER
    ) -> list[tuple[dict[str, Any], bytes | Pieces]]:
        """:meth:`feed`, but a payload of more than ``over`` bytes comes as the
        :class:`Pieces` it arrived in: a caller that puts several together (a file read in
        frames) joins them all once."""
        if data:
            self._pieces.append(data)
            self._have += len(data)
        frames: list[tuple[dict[str, Any], bytes | Pieces]] = []
        while True:
            if self._need is None:
                if self._have < HEADER.size:
                    return frames
                self._need = parse_lengths(self._take(HEADER.size))
            hlen, plen = self._need
            if self._have < hlen + plen:
                return frames
            header = parse_header(self._take(hlen))
            payload = self._take(plen, over is not None and plen > over)
            self._need = None
            frames.append((header, payload))

    def _take(self, size: int, pieces: bool = False) -> Any:
        """The next ``size`` bytes (there are that many), as :class:`Pieces` if asked."""
        if not size:
            return b""
        self._have -= size
        first = self._pieces[0]
        if not pieces and self._start + size <= len(first):  # within the first piece
            if self._start == 0 and size == len(first):
                self._pieces.pop(0)
                return first
            out = first[self._start : self._start + size]
            self._start += size
            if self._start == len(first):
                self._pieces.pop(0)
                self._start = 0
            return out
        parts: list[bytes | memoryview] = Pieces() if pieces else []
        while size:
            first = self._pieces[0]
            n = min(size, len(first) - self._start)
            # A whole piece goes as itself: a join of bytes only lets the GIL go (a thread
            # joining views holds it, and the event loop waits).
            whole = self._start == 0 and n == len(first) and type(first) is bytes
            parts.append(first if whole else memoryview(first)[self._start : self._start + n])
            size -= n
            self._start += n
            if self._start == len(first):
                self._pieces.pop(0)
                self._start = 0
        return parts if pieces else b"".join(parts)


class Pieces(list):  # type: ignore[type-arg]
    """A payload still in the pieces it arrived in: ``b"".join`` them (with others)."""


# ---- the same messages for the type checker (a test holds them equal to the tables) ---------
if TYPE_CHECKING:
    FileType = Literal["file", "dir", "symlink", "other"]

    class SpawnRequest(TypedDict):
        op: Literal["spawn"]
        id: int
        argv: list[str]
        env: NotRequired[dict[str, str]]
        cwd: NotRequired[str | None]
        stdin: NotRequired[Literal["null", "data", "pipe"]]
        """``data``: the payload is the whole stdin; ``pipe``: ``write`` requests follow."""
        rlimits: NotRequired[dict[str, int]]
        pty: NotRequired[bool]
        rows: NotRequired[int]
        cols: NotRequired[int]

    class WriteRequest(TypedDict):
        op: Literal["write"]
        id: int
        pid: int
        eof: NotRequired[bool]

    class CloseStdinRequest(TypedDict):
        op: Literal["close_stdin"]
        id: int
        pid: int

    class FlowRequest(TypedDict):
        """``hold``: stop reading the process's stdout and stderr (a reader on the host is
        behind: the process then blocks on a full pipe, as under any slow reader); False
        reads them again. A process on a terminal is never held."""

        op: Literal["flow"]
        id: int
        pid: int
        hold: bool

    class SignalRequest(TypedDict):
        op: Literal["signal"]
        id: int
        pid: int
        signal: int
        group: NotRequired[bool]

    class TerminateRequest(TypedDict):
        """SIGTERM to the process group now, SIGKILL to it ``grace`` seconds later unless
        the process is gone by then; its ``exit`` event follows as usual."""

        op: Literal["terminate"]
        id: int
        pid: int
        grace: float

    class ResizeRequest(TypedDict):
        op: Literal["resize"]
        id: int
        pid: int
        rows: int
        cols: int

    class StatsRequest(TypedDict):
        op: Literal["stats"]
        id: int
        pid: int

    class InfoRequest(TypedDict):
        op: Literal["info"]
        id: int

    class PingRequest(TypedDict):
        op: Literal["ping"]
        id: int

    class ShutdownRequest(TypedDict):
        op: Literal["shutdown"]
        id: int

    class FileReadRequest(TypedDict):
        op: Literal["file_read"]
        id: int
        root: str
        path: str
        offset: NotRequired[int]
        limit: NotRequired[int]

    class FileWriteRequest(TypedDict):
        op: Literal["file_write"]
        id: int
        root: str
        path: str
        append: NotRequired[bool]
        parents: NotRequired[bool]
        perm: NotRequired[int]

    class FileListRequest(TypedDict):
        op: Literal["file_list"]
        id: int
        root: str
        path: str

    class FileStatRequest(TypedDict):
        op: Literal["file_stat"]
        id: int
        root: str
        path: str

    class FileMkdirRequest(TypedDict):
        op: Literal["file_mkdir"]
        id: int
        root: str
        path: str
        parents: NotRequired[bool]

    class FileRemoveRequest(TypedDict):
        op: Literal["file_remove"]
        id: int
        root: str
        path: str
        recursive: NotRequired[bool]

    class PublishRequest(TypedDict):
        op: Literal["publish"]
        id: int
        port: int
        unix: str

    class Done(TypedDict):
        """The reply of an operation that only says it was done."""

        ok: NotRequired[bool]

    class SpawnReply(TypedDict):
        pid: int

    WriteReply = CloseStdinReply = FlowReply = ResizeReply = ShutdownReply = PublishReply = Done
    FileMkdirReply = FileRemoveReply = Done

    class SignalReply(TypedDict):
        delivered: bool
        """False when the process (group) was already gone."""

    TerminateReply = SignalReply

    class StatsReply(TypedDict):
        cpu_seconds: float
        rss_bytes: int
        state: str
        processes: int

    class InfoReply(TypedDict):
        kernel: str
        hostname: str
        arch: str
        cpus: int
        memory_bytes: int
        agent_pid: int
        python: str
        sandbox_id: NotRequired[str]
        workdir: NotRequired[str]
        landlock: NotRequired[dict[str, Any]]
        """``{"abi": N, "enforced": bool, "reason": why not, "scoped": [...]}``."""

    class PingReply(TypedDict):
        pass

    class FileReadReply(TypedDict):
        size: int
        offset: int
        eof: bool
        dev: NotRequired[int]
        """``dev`` and ``ino``: the file the agent opened as the command user, so the host
        can move the bulk of the bytes itself through an fd of that very file (files.py)."""
        ino: NotRequired[int]

    class FileWriteReply(TypedDict):
        size: int
        dev: NotRequired[int]
        ino: NotRequired[int]

    class FileEntry(TypedDict):
        name: str
        type: FileType
        size: int
        mode: int
        mtime: float

    class FileListReply(TypedDict):
        entries: list[FileEntry]
        truncated: bool

    class FileStatReply(TypedDict):
        exists: bool
        name: NotRequired[str]
        type: NotRequired[FileType]
        size: NotRequired[int]
        mode: NotRequired[int]
        mtime: NotRequired[float]

    class ErrorBody(TypedDict):
        code: str
        """One of :class:`ErrorCode`."""
        message: str

    class ErrorReply(TypedDict):
        re: int
        error: ErrorBody

    class ReadyEvent(TypedDict):
        ev: Literal["ready"]
        pid: int

    class OutEvent(TypedDict):
        ev: Literal["out"]
        pid: int
        stream: Literal["stdout", "stderr", "pty"]

    class ExitEvent(TypedDict):
        ev: Literal["exit"]
        pid: int
        exit_code: int
        """As ``subprocess`` reports it: ``-N`` when signal N killed the process."""
        signal: NotRequired[int]
        duration: NotRequired[float]
        """Seconds from spawn to exit, measured in the box."""
        cpu_seconds: NotRequired[float]
        """User + system CPU of the process and its reaped descendants (``wait4``)."""
        max_rss_bytes: NotRequired[int]
        """Its peak resident memory (the largest of it and its reaped descendants)."""
        box: NotRequired[dict[str, int]]
        """A microVM's guest cgroup counters (the host sees no cgroup of that box)."""

    Event = ReadyEvent | OutEvent | ExitEvent
