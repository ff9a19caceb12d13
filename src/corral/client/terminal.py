"""A person's terminal on a session held by ``corral serve``: ``corral shell``, ``attach``
and ``sessions`` when a server is running.

The terminal goes to raw mode and is bridged to the session's WebSocket
(``/v1/boxes/{id}/sessions/{sid}/attach``): keys go out as binary messages, the window size
as ``{"resize": [cols, rows]}`` on attach and on every SIGWINCH, the screen comes back as
binary messages. The detach keys (``ctrl-]`` by default) end the bridge and leave the session
running; the server closing the socket means the session ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import termios
import tty
from typing import Any

from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from corral.client.fast import Conn, ServerError, q
from corral.sessions.terminal import (
    DEFAULT_DETACH_KEYS,
    AttachOutcome,
    KeyBridge,
    _write_all,
    parse_detach_keys,
    window_size,
)
from corral.sessions.terminal import _watch_winch as watch_winch

__all__ = ["attach", "find_session", "list_sessions", "shell"]


async def _open(conn: Conn, path: str) -> ClientConnection:
    """The WebSocket at ``path``; a refusal is the server's error (its code and sentence)."""
    try:
        if conn.unix is not None:
            return await unix_connect(conn.unix, f"ws://localhost{path}", max_size=None)
        extra = {"Authorization": f"Bearer {conn.token}"} if conn.token else {}
        host = f"[{conn.host}]" if ":" in conn.host else conn.host
        url = f"ws://{host}:{conn.port}{path}"
        return await connect(url, additional_headers=extra, max_size=None)
    except InvalidStatus as exc:
        status = exc.response.status_code
        try:
            err = json.loads(exc.response.body or b"")["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "server_error", f"the server refused the terminal (HTTP {status})"
        raise ServerError(code, message, status) from None
    except (OSError, InvalidHandshake) as exc:
        raise ServerError(
            "server_unavailable", f"the server did not open the terminal's WebSocket ({exc})"
        ) from None


class _Bridge(KeyBridge):
    """One attach over a WebSocket (the state of :func:`bridge`)."""

    def __init__(self, ws: ClientConnection, keys: bytes, in_fd: int, out_fd: int) -> None:
        super().__init__(keys, in_fd, out_fd)
        self.ws = ws
        self.outgoing: asyncio.Queue[bytes | str | None] = asyncio.Queue()
        self.signalled: int | None = None
        """SIGTERM or SIGHUP that ended the attach (the terminal gone, or a kill)."""

    def on_signal(self, number: int) -> None:
        self.signalled = number
        self.finish(AttachOutcome("detached"))

    def forward(self, data: bytes) -> None:
        self.outgoing.put_nowait(data)

    def resize(self, cols: int, rows: int) -> None:
        self.outgoing.put_nowait(json.dumps({"resize": [cols, rows]}))

    async def send(self) -> None:
        while (message := await self.outgoing.get()) is not None:
            await self.ws.send(message)

    async def receive(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                if isinstance(message, bytes):
                    _write_all(self.out_fd, message)
        self.finish(AttachOutcome("exited" if self.ws.close_code == 1000 else "lost"))


_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that end an attach as the in-process one ends: the terminal restored first (a
default action left it raw, with no echo), then the caller's exit as 128 + the signal."""


async def bridge(
    conn: Conn, box: str, session: str, keys: bytes, in_fd: int = 0, out_fd: int = 1
) -> tuple[AttachOutcome, int | None]:
    """This terminal on the session until detach, the session's end, a lost server, or
    SIGTERM/SIGHUP (the second value: that signal's number)."""
    loop = asyncio.get_running_loop()
    ws = await _open(conn, f"/v1/boxes/{q(box)}/sessions/{q(session)}/attach")
    state = _Bridge(ws, keys, in_fd, out_fd)
    saved: list[Any] | None = None
    if os.isatty(in_fd):
        saved = termios.tcgetattr(in_fd)
        tty.setraw(in_fd, termios.TCSANOW)
    for number in _ENDING_SIGNALS:
        loop.add_signal_handler(number, state.on_signal, number)
    state.on_winch()
    loop.add_reader(in_fd, state.on_key)
    unwatch = watch_winch(loop, state.on_winch)
    tasks = [asyncio.ensure_future(state.send()), asyncio.ensure_future(state.receive())]
    try:
        return await state.done, state.signalled
    finally:
        loop.remove_reader(in_fd)
        unwatch()
        for task in tasks:
            task.cancel()
        if saved is not None:  # first: whatever follows may be cut short
            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        with contextlib.suppress(Exception):
            await ws.close()
        for number in _ENDING_SIGNALS:
            loop.remove_signal_handler(number)


def _say(message: str) -> None:
    print(f"\r\ncorral: {message}", file=sys.stderr, flush=True)


def _status(code: int | None) -> int:
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


def _session_exit(conn: Conn, box: str, session: str) -> int | None:
    try:
        for s in conn.json("GET", f"/v1/boxes/{q(box)}/sessions"):
            if s["id"] == session:
                code = s.get("exit_code")
                return None if code is None else int(code)
    except ServerError:
        return None
    return None


class _Signalled(Exception):
    """The attach ended by SIGTERM/SIGHUP: ``corral shell`` removes its box, then exits
    128 + the signal (``corral attach`` just exits: the session goes on)."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


def _attach_and_report(conn: Conn, box: str, session: str, keys_text: str) -> int:
    keys = parse_detach_keys(keys_text)
    ended, signalled = asyncio.run(bridge(conn, box, session, keys))
    if signalled is not None:
        raise _Signalled(signalled)
    if ended.reason == "detached":
        _say(
            f"detached from session {session} in {box}; `corral attach {session}` to return, "
            f"`corral rm {box}` to end the box"
        )
        return 0
    if ended.reason == "lost":
        _say(f"the server dropped session {session} (the box closed or the server stopped)")
        return 1
    code = _session_exit(conn, box, session)
    if code is None and _box_gone(conn, box):  # closed under the person: say so, as in-process
        _say(f"box {box} was closed (removed, or its lease ended): session {session} ended")
        return 129  # hung up
    return _status(code)


def _box_gone(conn: Conn, box: str) -> bool:
    try:
        conn.json("GET", f"/v1/boxes/{q(box)}")
    except ServerError as exc:
        return exc.code == "box_not_found"
    return False


def list_sessions(conn: Conn) -> list[dict[str, Any]]:
    """Every session of the server's boxes, with its box."""
    found: list[dict[str, Any]] = []
    for box in conn.json("GET", "/v1/boxes"):
        sessions = conn.json("GET", f"/v1/boxes/{q(box['id'])}/sessions")
        found.extend({**s, "box": box["id"], "labels": box.get("labels", {})} for s in sessions)
    return found


def find_session(conn: Conn, prefix: str) -> tuple[str, str]:
    """(box, session) of the one session whose id starts with ``prefix``."""
    matches = [s for s in list_sessions(conn) if str(s["id"]).startswith(prefix)]
    if len(matches) != 1:
        what = "no session" if not matches else f"{len(matches)} sessions"
        raise ServerError(
            "session_not_found",
            f"{what} on the server with an id starting {prefix!r}; `corral sessions` lists them",
        )
    return str(matches[0]["box"]), str(matches[0]["id"])


def attach(conn: Conn, session_prefix: str, keys_text: str = DEFAULT_DETACH_KEYS) -> int:
    box, session = find_session(conn, session_prefix)
    try:
        return _attach_and_report(conn, box, session, keys_text)
    except _Signalled as by:
        _say(f"{signal.Signals(by.number).name}: detached; session {session} runs on")
        return 128 + by.number


def shell(conn: Conn, flags: list[str], shell_path: str | None, keys_text: str) -> int:
    """A fresh box on the server with a shell, this terminal on it; the box is removed when
    the shell exits (kept, and said, on detach)."""
    parse_detach_keys(keys_text)  # a bad one fails before the box starts
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ServerError(
            "invalid_input",
            "corral shell needs a terminal on stdin and stdout; for piped input use "
            "corral run --stdin -- sh",
        )
    box = conn.json("POST", "/v1/boxes", {"cli_argv": flags, "labels": {"via": "corral-shell"}})
    box_id = str(box["id"])
    removed = False
    try:
        for warning in box.get("warnings", []):
            print(f"corral: warning: {warning}", file=sys.stderr)
        cols, rows = window_size(1)
        session = conn.json(
            "POST",
            f"/v1/boxes/{q(box_id)}/sessions",
            {"shell": shell_path, "cols": cols, "rows": rows},
        )
        sid = str(session["id"])
        print(
            f"corral: {session['shell']} in box {box_id} on the server (session {sid}); "
            f"{keys_text} detaches, exit ends it",
            file=sys.stderr,
            flush=True,
        )
        try:
            status = _attach_and_report(conn, box_id, sid, keys_text)
        except _Signalled as by:  # as in-process: the box goes with the shell
            removed = True
            _say(f"{signal.Signals(by.number).name}: closing box {box_id}")
            return 128 + by.number
        if _session_exit(conn, box_id, sid) is not None:
            removed = True
        return status
    finally:
        if removed or sys.exc_info()[0] is not None:
            with contextlib.suppress(ServerError):
                conn.request("DELETE", f"/v1/boxes/{q(box_id)}").read()
