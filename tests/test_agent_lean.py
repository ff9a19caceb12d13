"""The agent's lean JSON and poller (corral.agent.lean) behave as json and selectors do."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.agent import lean

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False),
    st.text(),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(values)
def test_dumps_is_compact_json_dumps(value: Any) -> None:
    assert lean.dumps(value) == json.dumps(value, separators=(",", ":"))


@given(values, st.sampled_from(["", " ", "\n\t "]))
def test_loads_is_json_loads(value: Any, pad: str) -> None:
    text = pad + json.dumps(value, indent=1) + pad
    assert lean.loads(text) == json.loads(text)
    assert lean.loads(text.encode()) == json.loads(text.encode())


def test_constants_parse_as_json_parses_them() -> None:
    assert lean.loads("[Infinity,-Infinity]") == [math.inf, -math.inf]
    assert math.isnan(lean.loads("NaN"))


@pytest.mark.parametrize(
    "bad", ["", "   ", "{", '{"a":1} x', "[1,]", "{'a': 1}", '"\x01"', b"\xff", "01"]
)
def test_what_json_refuses_is_a_value_error(bad: str | bytes) -> None:
    with pytest.raises(ValueError, match=r"Expecting|Extra|Invalid|codec"):
        json.loads(bad)
    with pytest.raises(ValueError, match=r"not JSON|Expecting|Invalid|codec"):
        lean.loads(bad)


def test_what_json_cannot_encode_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bytes"):
        lean.dumps({"a": b"x"})


def test_the_agents_start_imports_none_of_the_python_layers() -> None:
    """What lean is for: the agent's imports before "ready" leave these modules unloaded."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import lean; "
        "lean.loads(lean.dumps({'a': [1]})); lean.Poller().close(); "
        "heavy = ('json', 're', 'enum', 'selectors', 'contextlib', 'typing'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    agent_dir = os.path.dirname(lean.__file__)
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, agent_dir], capture_output=True, text=True
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_poller_reports_readable_and_writable_as_selectors_does() -> None:
    a, b = socket.socketpair()
    r, w = os.pipe()
    poller = lean.Poller()
    try:
        key = poller.register(a, lean.EVENT_READ, "chan")
        poller.register(r, lean.EVENT_READ, "wake")
        assert poller.select(0) == []
        b.send(b"x")
        os.write(w, b"y")
        got = {k.data: mask for k, mask in poller.select(1)}
        assert got == {"chan": lean.EVENT_READ, "wake": lean.EVENT_READ}
        poller.modify(a, lean.EVENT_READ | lean.EVENT_WRITE, "chan")
        assert poller.get_map()[a.fileno()] is key and key.events == 3
        both = {k.data: mask for k, mask in poller.select(1)}
        assert both["chan"] == lean.EVENT_READ | lean.EVENT_WRITE
        poller.unregister(r)
        assert poller.get_map().get(r) is None
        with pytest.raises(KeyError):
            poller.register(a, lean.EVENT_READ)
        with pytest.raises(ValueError, match="invalid events"):
            poller.modify(a, 0)
    finally:
        poller.close()
        a.close()
        b.close()
        os.close(r)
        os.close(w)


def test_a_closed_peer_wakes_a_reader() -> None:
    a, b = socket.socketpair()
    poller = lean.Poller()
    try:
        poller.register(a, lean.EVENT_READ, "chan")
        b.close()
        [(key, mask)] = poller.select(1)
        assert key.data == "chan" and mask == lean.EVENT_READ
        assert a.recv(1) == b""
    finally:
        poller.close()
        a.close()


def _tracking(decorate: Callable[..., Any], log: list[str], swallow: bool) -> Callable[[], Any]:
    @decorate
    def managed() -> Iterator[str]:
        log.append("enter")
        try:
            yield "value"
        except KeyError:
            log.append("caught")
            if not swallow:
                raise
        finally:
            log.append("exit")

    return managed  # type: ignore[no-any-return]


@pytest.mark.parametrize("swallow", [False, True])
@pytest.mark.parametrize("body", ["ok", "key", "value", "stop"])
def test_contextmanager_behaves_as_contextlibs(body: str, swallow: bool) -> None:
    def run(decorate: Callable[..., Any]) -> tuple[list[str], str]:
        log: list[str] = []
        outcome = "none"
        try:
            with _tracking(decorate, log, swallow)() as got:
                log.append(got)
                if body == "key":
                    raise KeyError("k")
                if body == "value":
                    raise ValueError("v")
                if body == "stop":
                    raise StopIteration
        except Exception as exc:
            outcome = type(exc).__name__
        return log, outcome

    assert run(lean.contextmanager) == run(contextlib.contextmanager)
