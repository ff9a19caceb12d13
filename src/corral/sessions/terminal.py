"""The human's end of an attach: bridge this process's terminal to a session server.

The terminal goes to raw mode so every key (Ctrl-C included) reaches the shell in the box;
the only keys kept back are the detach sequence (``ctrl-]`` by default, docker-style
``--detach-keys`` such as ``ctrl-q`` or ``ctrl-p,ctrl-q``). The window size is sent on
attach and on every SIGWINCH. The terminal is restored however the bridge ends.

Used by ``corral attach``/``corral shell`` and by the library's ``Sandbox.attach``,
``attach_shell`` and ``reattach`` (and their ``SyncSandbox`` twins). SIGWINCH reaches a
bridge through its event loop's signal handler when that loop runs in the main thread;
otherwise (the sync facade's loop thread) through :func:`forward_window_changes`, which the
calling main thread installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import termios
import threading
import tty
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from corral import errors
from corral.agent import protocol

__all__ = [
    "AttachOutcome",
    "DetachDetector",
    "attach_terminal",
    "check_input",
    "default_shell",
    "forward_window_changes",
    "parse_detach_keys",
    "window_size",
]

DEFAULT_DETACH_KEYS = "ctrl-]"
_CTRL_SYMBOLS = "@[\\]^_"


def parse_detach_keys(spec: str) -> bytes:
    """``"ctrl-]"`` -> ``b"\\x1d"``, ``"ctrl-p,ctrl-q"`` -> ``b"\\x10\\x11"``, ``"x"`` -> ``b"x"``.

    The docker syntax: comma-separated keys, each ``ctrl-<letter or @[\\]^_>`` or one character.
    """
    keys = bytearray()
    for raw in spec.split(","):
        key = raw.strip()
        lowered = key.lower()
        if lowered.startswith("ctrl-") and len(key) == 6:
            char = key[5].upper()
            if not ("A" <= char <= "Z" or char in _CTRL_SYMBOLS):
                raise _bad_keys(spec)
            keys.append(ord(char) & 0x1F)
        elif len(key) == 1 and key.isprintable():
            keys.append(ord(key))
        else:
            raise _bad_keys(spec)
    return bytes(keys)


def _bad_keys(spec: str) -> errors.SandboxError:
    return errors.SandboxError(
        f"invalid detach keys {spec!r}: use ctrl-<letter or one of @[\\]^_> or a single "
        "character, comma-separated, e.g. ctrl-] or ctrl-p,ctrl-q",
        code=errors.ErrorCode.INVALID_INPUT,
    )


class DetachDetector:
    """Sans-IO: split typed bytes into what to forward and whether detach was typed.

    A partial detach sequence is held back until the next key decides; if that key does not
    continue the sequence, the held keys are forwarded after all (as docker does).
    """

    __slots__ = ("_keys", "_matched")

    def __init__(self, keys: bytes) -> None:
        if not keys:
            raise _bad_keys("")
        self._keys = keys
        self._matched = 0

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        forward = bytearray()
        for byte in data:
            if byte == self._keys[self._matched]:
                self._matched += 1
                if self._matched == len(self._keys):
                    self._matched = 0
                    return bytes(forward), True
                continue
            if self._matched:
                forward += self._keys[: self._matched]
                self._matched = 1 if byte == self._keys[0] else 0
                if self._matched:
                    continue
            forward.append(byte)
        return bytes(forward), False


@dataclass(frozen=True, slots=True)
class AttachOutcome:
    """How an attach ended: the human detached (the session runs on; re-attach with its
    ``session_id``), the program exited (``exit_code``: its status, ``-N`` for signal N),
    or the session's owner went away (the sandbox closed)."""

    reason: Literal["detached", "exited", "lost"]
    exit_code: int | None = None
    session_id: str = ""

    @property
    def detached(self) -> bool:
        return self.reason == "detached"


def check_input(fd: int) -> None:
    """Refuse input an event loop cannot wait on (a regular file, ``/dev/null``) before
    anything starts: a terminal, a pipe or a socket is needed."""
    poller = select.epoll()
    try:
        poller.register(fd, select.EPOLLIN)
    except PermissionError:
        raise errors.SandboxError(
            f"attach reads keys from fd {fd}, which is a regular file or a device that cannot "
            "be waited on (such as /dev/null); give a terminal, a pipe or a socket (for input "
            "from a file use Sandbox.run(stdin=...) or spawn)",
            code=errors.ErrorCode.INVALID_INPUT,
        ) from None
    except OSError as exc:
        raise errors.SandboxError(
            f"attach cannot read keys from fd {fd}: {exc.strerror or exc}",
            code=errors.ErrorCode.INVALID_INPUT,
        ) from None
    finally:
        poller.close()


def window_size(fd: int) -> tuple[int, int]:
    """(columns, rows) of the terminal on ``fd``; 80x24 when it is not a terminal."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return size.columns or 80, size.lines or 24


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue  # a non-blocking terminal that is momentarily full


class KeyBridge:
    """What every terminal bridge shares, whatever carries it (the attach socket's frames,
    ``corral serve``'s WebSocket): keys read from ``in_fd`` go out through :meth:`forward`
    until the detach keys (or the end of input) detach, the window size goes out through
    :meth:`resize`, and ``done`` holds how the attach ended."""

    def __init__(self, keys: bytes, in_fd: int, out_fd: int) -> None:
        self.detector = DetachDetector(keys)
        self.in_fd, self.out_fd = in_fd, out_fd
        self.done: asyncio.Future[AttachOutcome] = asyncio.get_running_loop().create_future()

    def forward(self, data: bytes) -> None:
        raise NotImplementedError

    def resize(self, cols: int, rows: int) -> None:
        raise NotImplementedError

    def detaching(self) -> None:
        """The person detached: tell the other side if it wants to know."""

    def finish(self, outcome: AttachOutcome) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def on_key(self) -> None:
        try:
            data = os.read(self.in_fd, 4096)
        except BlockingIOError:
            return
        forward, detach = self.detector.feed(data)
        if forward:
            self.forward(forward)
        if detach or not data:  # end of our input detaches too: the session lives on
            self.detaching()
            self.finish(AttachOutcome("detached"))

    def on_winch(self) -> None:
        self.resize(*window_size(self.out_fd))


class _Bridge(KeyBridge):
    """One attach: forwards keys to the server and output frames to the terminal."""

    def __init__(self, writer: asyncio.StreamWriter, keys: bytes, in_fd: int, out_fd: int) -> None:
        super().__init__(keys, in_fd, out_fd)
        self.writer = writer

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if not self.writer.is_closing():
            self.writer.write(protocol.encode(header, payload))

    def forward(self, data: bytes) -> None:
        self.send({"op": "input"}, data)

    def resize(self, cols: int, rows: int) -> None:
        self.send({"op": "resize", "cols": cols, "rows": rows})

    def detaching(self) -> None:
        self.send({"op": "detach"})

    def on_frame(self, message: dict[str, Any], payload: bytes) -> None:
        if message.get("ev") == "out":
            _write_all(self.out_fd, payload)
        elif message.get("ev") == "exit":
            code = message.get("exit_code")
            self.finish(AttachOutcome("exited", code if isinstance(code, int) else None))

    async def pump(self, reader: asyncio.StreamReader, decoder: protocol.FrameDecoder) -> None:
        while chunk := await reader.read(65536):
            for frame in decoder.feed(chunk):
                self.on_frame(*frame)
        self.finish(AttachOutcome("lost"))


async def _handshake(
    reader: asyncio.StreamReader, decoder: protocol.FrameDecoder, session_id: str
) -> tuple[bytes, list[tuple[dict[str, Any], bytes]]]:
    """The server's answer to attach: the replay, plus any frames that came with it."""
    frames: list[tuple[dict[str, Any], bytes]] = []
    while not frames:
        chunk = await reader.read(65536)
        if not chunk:
            raise errors.SessionNotFound(f"the owner of session {session_id} hung up")
        frames = decoder.feed(chunk)
    header, replay = frames.pop(0)
    if "error" in header:
        error = header["error"]
        message = error.get("message") if isinstance(error, dict) else None
        raise errors.SessionNotFound(str(message or "attach refused"))
    return replay, frames


async def attach_terminal(
    server: Path,
    session_id: str,
    *,
    detach_keys: bytes = b"\x1d",
    in_fd: int = 0,
    out_fd: int = 1,
) -> AttachOutcome:
    """Bridge the terminal on ``in_fd``/``out_fd`` to a session until detach or exit."""
    check_input(in_fd)  # before connecting: nothing starts for input that cannot be read
    reader, writer = await asyncio.open_unix_connection(str(server))
    loop = asyncio.get_running_loop()
    bridge = _Bridge(writer, detach_keys, in_fd, out_fd)
    saved: list[Any] | None = None
    try:
        cols, rows = window_size(out_fd)
        bridge.send({"op": "attach", "session_id": session_id, "cols": cols, "rows": rows})
        decoder = protocol.FrameDecoder()
        replay, early = await _handshake(reader, decoder, session_id)
        if os.isatty(in_fd):
            saved = termios.tcgetattr(in_fd)
            tty.setraw(in_fd, termios.TCSANOW)  # keep keys typed ahead: they are for the shell
        _write_all(out_fd, replay)
        for frame in early:
            bridge.on_frame(*frame)
        loop.add_reader(in_fd, bridge.on_key)
        unwatch = _watch_winch(loop, bridge.on_winch)
        pumping = asyncio.create_task(bridge.pump(reader, decoder))
        try:
            return replace(await bridge.done, session_id=session_id)
        finally:
            loop.remove_reader(in_fd)
            unwatch()
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await pumping
    finally:
        if saved is not None:
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


# ---- window changes when the loop is not the main thread's ------------------------------------
_winch_listeners: dict[int, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
_winch_ids = iter(range(1 << 62))


def _watch_winch(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], None]
) -> Callable[[], None]:
    """Call ``callback`` in ``loop`` on every SIGWINCH; returns the undo."""
    if threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGWINCH, callback)

        def remove() -> None:
            loop.remove_signal_handler(signal.SIGWINCH)

        return remove
    key = next(_winch_ids)
    _winch_listeners[key] = (loop, callback)

    def forget() -> None:
        _winch_listeners.pop(key, None)

    return forget


def _window_changed(signum: int, frame: object) -> None:
    for loop, callback in list(_winch_listeners.values()):
        with contextlib.suppress(RuntimeError):  # a loop that has just closed
            loop.call_soon_threadsafe(callback)


@contextlib.contextmanager
def forward_window_changes() -> Iterator[None]:
    """While inside: SIGWINCH, caught by this (main) thread, reaches the bridges running in
    other threads' loops. Elsewhere than the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGWINCH, _window_changed)
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


async def default_shell(run: Callable[..., Awaitable[Any]]) -> str:
    """bash (line editing, history) when the box has it, else /bin/sh; ``run`` is a
    sandbox's ``run``."""
    found = await run(["sh", "-c", "command -v bash"], timeout=10)
    path = str(found.stdout).strip()
    return path if found.exit_code == 0 and path.startswith("/") else "/bin/sh"
