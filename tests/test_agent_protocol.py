"""The protocol module is the one definition of the wire: tables, types and error codes agree,
the host maps every code, and both ends refuse what is not in it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, UnionType
from typing import Any, Literal, get_args, get_origin

import pytest

from corral import Sandbox, errors
from corral.agent import protocol
from corral.channel import ERRORS, error_from_reply


def typed_protocol() -> ModuleType:
    """The protocol module as the type checker sees it (its ``TypedDict``s defined)."""
    source = Path(protocol.__file__).read_text()
    source = source.replace("TYPE_CHECKING = False", "TYPE_CHECKING = True", 1)
    module = ModuleType("typed_protocol")
    exec(compile(source, protocol.__file__, "exec"), module.__dict__)
    return module


def kind(annotation: Any) -> str:
    """The runtime table's kind for a ``TypedDict`` field's type."""
    simple = {int: "int", float: "number", str: "str", bool: "bool"}
    if annotation in simple:
        return simple[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "str"
    if origin in (UnionType, typing.Union) and set(args) == {str, type(None)}:
        return "str|null"
    if origin is list:
        return "[entry]" if typing.is_typeddict(args[0]) else f"[{kind(args[0])}]"
    if origin is dict:
        return "{}" if args[1] is Any else "{" + kind(args[1]) + "}"
    raise AssertionError(f"no kind for {annotation!r}")


def table_of(cls: Any, skip: frozenset[str]) -> dict[str, str]:
    # With string annotations, 3.11's __required_keys__ misses NotRequired: read it here.
    hints = typing.get_type_hints(cls, globalns=vars(TYPED), include_extras=True)
    table = {}
    for name, hint in hints.items():
        if name in skip:
            continue
        optional = get_origin(hint) is typing.NotRequired
        table[name] = ("?" if optional else "") + kind(get_args(hint)[0] if optional else hint)
    return table


def type_name(name: str, suffix: str) -> str:
    return "".join(part.title() for part in name.split("_")) + suffix


TYPED = typed_protocol()


def test_the_runtime_tables_are_the_typed_messages() -> None:
    typed = TYPED
    for op, fields in protocol.REQUESTS.items():
        assert table_of(getattr(typed, type_name(op, "Request")), frozenset({"op", "id"})) == fields
        assert table_of(getattr(typed, type_name(op, "Reply")), frozenset()) == protocol.REPLIES[op]
    for ev, fields in protocol.EVENTS.items():
        assert table_of(getattr(typed, type_name(ev, "Event")), frozenset({"ev"})) == fields
    assert table_of(typed.FileEntry, frozenset()) == protocol.ENTRY
    assert set(protocol.REPLIES) == set(protocol.REQUESTS)


def test_every_agent_error_code_maps_to_one_corral_error() -> None:
    assert set(ERRORS) == protocol.ERROR_CODES
    for code in protocol.ERROR_CODES:
        err = error_from_reply({"re": 1, "error": {"code": code, "message": "m"}})
        assert isinstance(err, errors.SandboxError) and err.message == "m"
    unknown = error_from_reply({"re": 1, "error": {"code": "made_up", "message": "m"}})
    assert isinstance(unknown, errors.ProtocolError)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ({"op": "format_disk", "id": 1}, "unknown operation"),
        ({"op": "signal", "id": 1, "pid": 3}, "no 'signal'"),
        ({"op": "signal", "id": 1, "pid": True, "signal": 9}, "a bad 'pid'"),
        ({"op": "spawn", "id": 1, "argv": []}, "empty 'argv'"),
        ({"op": "spawn", "id": 1, "argv": ["true"], "env": {"A": 1}}, "a bad 'env'"),
        ({"op": "terminate", "id": 1, "pid": 3, "grace": "2"}, "a bad 'grace'"),
    ],
)
def test_malformed_requests_are_refused(header: dict[str, Any], problem: str) -> None:
    with pytest.raises(protocol.FrameError, match=problem):
        protocol.check_request(header)


@pytest.mark.parametrize(
    ("op", "reply"),
    [
        ("spawn", {"re": 1}),
        ("stats", {"re": 1, "cpu_seconds": "1", "rss_bytes": 1, "state": "R", "processes": 1}),
        ("file_list", {"re": 1, "entries": [{"name": "x"}], "truncated": False}),
        ("file_stat", {"re": 1, "exists": True, "type": "socket"}),
    ],
)
def test_malformed_replies_break_the_protocol(op: str, reply: dict[str, Any]) -> None:
    with pytest.raises(protocol.FrameError):
        protocol.check_reply(op, reply)


def test_well_formed_events_pass() -> None:
    exit_event = {"ev": "exit", "pid": 3, "exit_code": -9, "signal": 9, "duration": 0.5}
    assert protocol.check_event(exit_event) == "exit"
    with pytest.raises(protocol.FrameError):
        protocol.check_event({**exit_event, "box": {"oom_kills": "1"}})


@pytest.fixture
def agent() -> Iterator[socket.socket]:
    """The real agent as a plain process (no box): the host end of its channel, after
    ``ready``. Closing the channel ends it."""
    host, guest = socket.socketpair()
    config = {"fd": guest.fileno(), "uid": os.getuid(), "gid": os.getgid()}
    script = Path(protocol.__file__).with_name("agent.py")
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(script), json.dumps(config)], pass_fds=[guest.fileno()]
    )
    guest.close()
    host.settimeout(30)
    try:
        assert read_frames(host, 1)[0][0]["ev"] == "ready"
        yield host
    finally:
        host.close()
        assert proc.wait(timeout=30) == 0


def read_frames(sock: socket.socket, count: int) -> list[tuple[dict[str, Any], bytes]]:
    decoder = protocol.FrameDecoder()
    frames: list[tuple[dict[str, Any], bytes]] = []
    while len(frames) < count:
        data = sock.recv(65536)
        assert data, "the agent closed the channel"
        frames += decoder.feed(data)
    return frames


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        ({"op": "stats", "id": 1, "pid": "1"}, "protocol_error", "a bad 'pid'"),
        ({"op": "reboot", "id": 2}, "protocol_error", "unknown operation 'reboot'"),
        ({"op": "terminate", "id": 3, "pid": 99999, "grace": 0}, "process_not_found", "99999"),
    ],
)
def test_the_agent_answers_a_bad_request_with_its_error_code(
    agent: socket.socket, request_: dict[str, Any], code: str, message: str
) -> None:
    agent.sendall(protocol.encode(request_))
    [(reply, _)] = read_frames(agent, 1)
    assert reply["re"] == request_["id"] and reply["error"]["code"] == code
    assert message in reply["error"]["message"]
    agent.sendall(protocol.encode({"op": "ping", "id": 9}))  # and it serves on
    assert read_frames(agent, 1)[0][0] == {"re": 9}


@pytest.mark.needs_bwrap
async def test_the_host_refuses_to_send_a_malformed_request(sandbox: Sandbox) -> None:
    with pytest.raises(errors.SandboxError, match="a bad 'pid'") as caught:
        await sandbox._request("stats", pid="1")
    assert caught.value.code == errors.ErrorCode.INVALID_INPUT
    assert (await sandbox.run("echo ok")).stdout == "ok\n"
