"""Every tool rejects malformed input with a structured error, and random JSON never crashes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corral import Sandbox
from corral.tools import SecretStore, Toolbox
from corral.tools.catalog import TOOLS

pytestmark = pytest.mark.needs_bwrap

HUGE = "x" * 1_000_001
MALFORMED: list[tuple[str, Any, str]] = [
    ("run_command", {}, "command"),
    ("run_command", {"command": ["ls"]}, "command"),
    ("run_command", {"command": "ls", "wait": "yes"}, "wait"),
    ("run_command", {"command": "ls", "timeout_secs": -1}, "timeout_secs"),
    ("run_command", {"command": "ls", "surprise": 1}, "surprise"),
    ("run_command", {"command": "ls", "env": {"1BAD": "x"}}, "env.1BAD.[key]"),
    ("run_command", {"command": "x" * 70_000}, "command"),
    ("wait_for_process", {"pid": "1"}, "pid"),
    ("wait_for_process", {"pid": 0}, "pid"),
    ("read_process_output", {"pid": 1, "stream": "stdin"}, "stream"),
    ("kill_process", {"pid": 1.5}, "pid"),
    ("process_stats", {"pid": True}, "pid"),
    ("list_processes", {"all": True}, "all"),
    ("open_shell", {"shell": ""}, "shell"),
    ("shell_write", {"session_id": "s", "input": HUGE}, "input"),
    ("shell_read", {}, "session_id"),
    ("shell_expect", {"session_id": "s", "pattern": "(unclosed"}, "pattern"),
    ("shell_expect", {"session_id": "s", "pattern": "a", "timeout_secs": "5"}, "timeout_secs"),
    ("shell_expect_cases", {"session_id": "s", "cases": []}, "cases"),
    (
        "shell_expect_cases",
        {"session_id": "s", "cases": [{"pattern": "a", "respond": "$2"}]},
        "cases.0.respond",
    ),
    ("shell_batch", {"session_id": "s", "steps": [{"type": "jump"}]}, "steps.0"),
    (
        "shell_batch",
        {"session_id": "s", "steps": [{"type": "expect", "pattern": "["}]},
        "steps.0.expect.pattern",
    ),
    ("shell_signal", {"session_id": 3}, "session_id"),
    ("vfs_list", {"path": None}, "path"),
    ("vfs_read", {}, "path"),
    ("vfs_write", {"path": "a", "content": HUGE}, "content"),
    ("sandbox.exec", {"runtime": "ruby", "code": "1"}, "runtime"),
    ("sandbox.exec", {"runtime": "sh", "code": "1", "timeout_ms": 0}, "timeout_ms"),
    ("sandbox.exec", {"runtime": "sh", "code": "1", "secrets": ["K"]}, "secrets"),
    ("sandbox_info", {"verbose": True}, "verbose"),
    ("kill_process", {"pid": 1, "signal": "SIGNOPE"}, "signal"),
    ("shell_signal", {"session_id": "s", "signal": "HUP!"}, "signal"),
]
NOT_FOUND: list[tuple[str, dict[str, Any], str]] = [
    ("wait_for_process", {"pid": 4242}, "process_not_found"),
    ("read_process_output", {"pid": 4242}, "process_not_found"),
    ("kill_process", {"pid": 4242}, "process_not_found"),
    ("process_stats", {"pid": 4242}, "process_not_found"),
    ("shell_write", {"session_id": "nope", "input": "x"}, "session_not_found"),
    ("shell_read", {"session_id": "nope"}, "session_not_found"),
    ("shell_expect", {"session_id": "nope", "pattern": "x"}, "session_not_found"),
    ("shell_signal", {"session_id": "nope"}, "session_not_found"),
    ("vfs_read", {"path": "../../etc/passwd"}, "path_outside_sandbox"),
    ("vfs_read", {"path": "missing.txt"}, "file_not_found"),
]


def tools(sandbox: Sandbox) -> Toolbox:
    return Toolbox(sandbox, secrets=SecretStore())


@pytest.mark.parametrize(("tool", "arguments", "field"), MALFORMED)
async def test_malformed_input_names_the_field(
    sandbox: Sandbox, tool: str, arguments: Any, field: str
) -> None:
    result = await tools(sandbox).call(tool, arguments)
    assert result["error"]["code"] == "invalid_input", result
    assert field in result["fields"], result
    assert len(result["error"]["message"]) < 2_000


@pytest.mark.parametrize(("tool", "arguments", "code"), NOT_FOUND)
async def test_unknown_pids_sessions_and_paths_are_structured_errors(
    sandbox: Sandbox, tool: str, arguments: dict[str, Any], code: str
) -> None:
    result = await tools(sandbox).call(tool, arguments)
    assert result["error"]["code"] == code, result


@pytest.mark.parametrize("arguments", [None, [], "text", 3])
async def test_non_object_input_is_invalid(sandbox: Sandbox, arguments: Any) -> None:
    result = await tools(sandbox).call("vfs_list", arguments)
    expected = "invalid_input" if arguments is not None else None
    assert result.get("error", {}).get("code") == expected


async def test_unknown_tool_is_a_structured_error(sandbox: Sandbox) -> None:
    result = await tools(sandbox).call("format_disk", {})
    assert result["error"]["code"] == "unknown_tool"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = sorted(
    {name for t in TOOLS for name in t.args.model_fields} | {"type", "pattern", "input"}
)
tool_inputs = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=8), json_values, max_size=5
)


@pytest.fixture(scope="module")
def shared_toolbox() -> Iterator[tuple[asyncio.AbstractEventLoop, Toolbox]]:
    # One sandbox for every example: hypothesis drives a private loop from a sync test.
    loop = asyncio.new_event_loop()
    sandbox = Sandbox()
    loop.run_until_complete(sandbox.start())
    try:
        yield loop, tools(sandbox)
    finally:
        loop.run_until_complete(sandbox.aclose())
        loop.close()


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tool=st.sampled_from([t.name for t in TOOLS]), arguments=tool_inputs | json_values)
def test_random_json_never_crashes_a_tool(
    shared_toolbox: tuple[asyncio.AbstractEventLoop, Toolbox], tool: str, arguments: Any
) -> None:
    loop, toolbox = shared_toolbox
    if isinstance(arguments, dict):
        # Bound what a lucky draw could start: nothing may block the suite.
        for key in ("timeout_secs", "timeout_ms"):
            arguments.pop(key, None)
        if tool in ("run_command", "sandbox.exec"):
            arguments.setdefault("timeout_secs" if tool == "run_command" else "timeout_ms", 1)
    result = loop.run_until_complete(asyncio.wait_for(toolbox.call(tool, arguments), 10))
    assert isinstance(result, dict)
    if "error" in result:
        assert set(result["error"]) == {"code", "message"}
        assert result["error"]["code"] != "internal_error", result
