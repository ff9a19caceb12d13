"""The agent tools through Toolbox.call, on real sandboxes."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from conftest import backend_policy
from corral import Policy, Sandbox
from corral.tools import Rule, SecretStore, Toolbox, catalog, tool_schemas
from corral.tools.approvals import ApprovalRequest
from corral.tools.catalog import TOOLS

pytestmark = pytest.mark.needs_bwrap


@pytest.fixture(autouse=True)
def _schemas_built() -> None:
    """The tools' schemas built before each test's event loop runs (once per process; off
    the loop). A process's first Toolbox builds them in a thread, and that thread's share of
    the GIL slows the loop's steps past the watch's 20 ms for its ~15 ms of pydantic work:
    a one-time cost the first test of the file used to pay, whichever it was. The warm-up
    itself is tested below (test_a_toolbox_builds_nothing_slow_on_the_event_loop)."""
    catalog.warm_schemas()


TF_SCRIPT = """\
echo 'Plan: 1 to add, 0 to change, 0 to destroy.'
printf '  Enter a value: '
read answer
[ "$answer" = yes ] && echo 'Apply complete! Resources: 1 added.'
"""


def box(sandbox: Sandbox, **kwargs: Any) -> Toolbox:
    kwargs.setdefault("secrets", SecretStore({"my-api-key": "sk-live-abcdef123456"}))
    return Toolbox(sandbox, **kwargs)


async def test_run_command_oneshot_returns_the_spec_shape(sandbox: Sandbox) -> None:
    result = await box(sandbox).call(
        "run_command", {"command": "sh", "args": ["-c", "echo out; echo err >&2; exit 3"]}
    )
    assert set(result) == {
        "pid", "exit_code", "ended", "timed_out", "timeout_secs", "stdout", "stderr"
    }  # fmt: skip
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (3, "out\n", "err\n")
    assert (result["ended"], result["timeout_secs"]) == ("exited", 60)  # the tool's default


async def test_run_command_reports_a_signal_and_the_policy_timeout(
    box_policy: Policy, workspace: Path
) -> None:
    limits = box_policy.limits.model_copy(update={"exec_timeout_secs": 45.0})
    async with Sandbox(box_policy.model_copy(update={"limits": limits}), workspace=workspace) as sb:
        result = await box(sb).call("run_command", {"command": "kill -USR1 $$"})
    assert (result["exit_code"], result["ended"], result["timeout_secs"]) == (-10, "signalled", 45)


async def test_run_command_timeout_kills_and_reports_timed_out(sandbox: Sandbox) -> None:
    result = await box(sandbox).call(
        "run_command", {"command": "echo started; sleep 30", "timeout_secs": 0.3}
    )
    assert result["timed_out"] is True
    assert (result["ended"], result["timeout_secs"]) == ("timed_out", 0.3)
    assert result["stdout"] == "started\n"


async def test_background_job_is_polled_with_wait_and_read(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    await tools.call("vfs_write", {"path": "go", "content": ""})
    started = await tools.call(
        "run_command",
        {
            "command": "echo step1 >&2; while [ ! -s go ]; do sleep 0.01; done; echo done >&2",
            "wait": False,
        },
    )
    assert started["status"] == "running" and "wait_for_process" in started["hint"]
    pid = started["pid"]
    waited = await tools.call("wait_for_process", {"pid": pid, "timeout_ms": 50})
    assert waited == {
        "pid": pid,
        "status": "timeout",
        "message": "process still running after 50ms",
    }
    proc = sandbox.process(pid)
    stream = proc.subscribe()  # waits for the first output (which may already be here)
    async with asyncio.timeout(5):
        if not proc.output("stderr"):
            assert await stream.get() == ("stderr", b"step1\n")
    partial = await tools.call("read_process_output", {"pid": pid, "stream": "stderr"})
    assert (partial["status"], partial["output"]) == ("running", "step1\n")
    await tools.call("vfs_write", {"path": "go", "content": "x"})
    assert await tools.call("wait_for_process", {"pid": pid, "timeout_ms": 5000}) == {
        "pid": pid,
        "status": "exited",
        "exit_code": 0,
    }
    final = await tools.call("read_process_output", {"pid": pid, "stream": "stderr"})
    assert final["output"] == "step1\ndone\n"
    listed = await tools.call("list_processes", {})
    assert any(p["pid"] == pid and p["status"] == "exited" for p in listed["processes"])


async def test_a_cancelled_wait_for_process_call_leaves_the_background_job_running(
    sandbox: Sandbox,
) -> None:
    tools = box(sandbox)
    started = await tools.call("run_command", {"command": "sleep 30", "wait": False})
    call = asyncio.create_task(
        tools.call("wait_for_process", {"pid": started["pid"], "timeout_ms": 60000})
    )
    await asyncio.sleep(0)  # the call is waiting
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    proc = sandbox.process(started["pid"])
    assert (await proc.wait(0.2)).status == "timeout"  # still running
    assert (await proc.terminate()).exit_code == -15


@pytest.mark.parametrize(
    ("runtime", "code"),
    [
        ("sh", 'read x; echo "$x" | tr a-z A-Z'),
        ("python3", "import sys\nprint(sys.stdin.read().upper())"),
        (
            "node",
            "let d='';process.stdin.on('data',c=>d+=c).on('end',()=>console.log(d.toUpperCase()))",
        ),
    ],
)
async def test_sandbox_exec_runs_each_runtime_with_stdin(
    sandbox: Sandbox, runtime: str, code: str
) -> None:
    result = await box(sandbox).call(
        "sandbox.exec", {"runtime": runtime, "code": code, "stdin": "hello world"}
    )
    assert result["exit_code"] == 0, result
    assert result["stdout"].strip() == "HELLO WORLD"


async def test_sandbox_exec_timeout_is_worded_as_the_spec(sandbox: Sandbox) -> None:
    result = await box(sandbox).call(
        "sandbox.exec", {"runtime": "sh", "code": "sleep 30", "timeout_ms": 100}
    )
    assert result["error"] == {"code": "timeout", "message": "timeout"}


async def test_sandbox_exec_secret_reaches_process_but_is_redacted(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    result = await tools.call(
        "sandbox.exec",
        {
            "runtime": "sh",
            "code": "echo key=$API_KEY; echo $API_KEY > leaked",
            "secrets": {"API_KEY": "{{secret:my-api-key}}"},
        },
    )
    assert result["stdout"] == "key=[REDACTED:my-api-key]\n"
    assert (await tools.call("vfs_read", {"path": "leaked"}))[
        "content"
    ] == "[REDACTED:my-api-key]\n"
    assert await sandbox.files.read_text("leaked") == "sk-live-abcdef123456\n"


SECRET = "sk-live-abcdef123456"
HALVES = "head -c 10 s; {wait}; tail -c +11 s"  # the value in two writes, a pause between
GO = "while [ ! -e go ]; do sleep 0.01; done"


def _no_piece_of_the_secret(*texts: str) -> None:
    for text in texts:
        for i in range(len(SECRET) - 5):
            assert SECRET[i : i + 6] not in text, text


async def test_a_secret_printed_across_two_shell_reads_is_redacted(sandbox: Sandbox) -> None:
    """shell_read returns the output since the last read: a value printed in two pieces must
    not reach the model as two clear halves (the first half is held back)."""
    tools = box(sandbox)
    await sandbox.files.write("s", SECRET)
    sid = (await tools.call("open_shell", {"shell": "/bin/sh"}))["session_id"]
    session = sandbox.session(sid)
    seen = bytearray()
    half_out = asyncio.Event()

    def watch(data: bytes | None) -> None:
        seen.extend(data or b"")
        if SECRET[:10].encode() in seen:
            half_out.set()

    session.watch(watch)
    command = HALVES.format(wait=GO) + "; echo EN''D\n"
    await tools.call("shell_write", {"session_id": sid, "input": command})
    async with asyncio.timeout(10):
        await half_out.wait()  # the shell printed the first half and waits for go
    first = (await tools.call("shell_read", {"session_id": sid}))["output"]
    await tools.call("vfs_write", {"path": "go", "content": ""})
    rest = await tools.call("shell_expect", {"session_id": sid, "pattern": "END"})
    assert rest["matched"], rest
    _no_piece_of_the_secret(first, rest["output"])
    assert "[REDACTED:my-api-key]END" in first + rest["output"]


async def test_a_running_process_s_partial_secret_is_held_back(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    await sandbox.files.write("s", SECRET)
    script = "while [ ! -e start ]; do sleep 0.01; done; " + HALVES.format(wait=GO)
    pid = (await tools.call("run_command", {"command": script, "wait": False}))["pid"]
    events = sandbox.registry.get(pid).subscribe(hold=False)
    await tools.call("vfs_write", {"path": "start", "content": ""})
    async with asyncio.timeout(10):
        assert await events.get() == ("stdout", SECRET[:10].encode())
    partial = await tools.call("read_process_output", {"pid": pid})
    assert partial["status"] == "running" and partial["output"] == "", partial
    await tools.call("vfs_write", {"path": "go", "content": ""})
    await tools.call("wait_for_process", {"pid": pid, "timeout_ms": 10_000})
    final = await tools.call("read_process_output", {"pid": pid})
    assert final["output"] == "[REDACTED:my-api-key]"


def test_redact_stream_holds_the_start_of_a_value_until_it_is_decided() -> None:
    store = SecretStore({"tok": SECRET})
    shown, held = store.redact_stream("", "key: sk-live-ab", final=False)
    assert (shown, held) == ("key: ", "sk-live-ab")
    assert store.redact_stream(held, "cdef123456\n", final=False) == ("[REDACTED:tok]\n", "")
    assert store.redact_stream(held, "x", final=False) == ("sk-live-abx", "")  # not the value
    assert store.redact_stream("", "a sk-l", final=True) == ("a [REDACTED:tok]", "")
    assert store.redact_stream("", "ends with s", final=True) == ("ends with s", "")


async def test_unknown_secret_and_raw_values_are_refused(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    unknown = await tools.call(
        "sandbox.exec", {"runtime": "sh", "code": "true", "secrets": {"K": "{{secret:nope}}"}}
    )
    assert unknown["error"]["code"] == "invalid_input" and "nope" in unknown["error"]["message"]
    raw = await tools.call(
        "sandbox.exec", {"runtime": "sh", "code": "true", "secrets": {"K": "plain"}}
    )
    assert raw["error"]["code"] == "invalid_input"


async def test_runtime_not_found_is_worded_as_the_spec(workspace: Path) -> None:
    async with Sandbox(Policy(env={"PATH": "/nonexistent"}), workspace=workspace) as sb:
        result = await box(sb).call("sandbox.exec", {"runtime": "python3", "code": "print(1)"})
    assert result["error"] == {"code": "runtime_not_found", "message": "runtime not found: python3"}


async def test_capability_denial_says_access_denied(sandbox: Sandbox) -> None:
    tools = box(sandbox, capabilities={"tool.invoke:run_command"})
    assert await tools.call("sandbox.exec", {"runtime": "sh", "code": "id"}) == {
        "error": {"code": "access_denied", "message": "access denied: sandbox.exec"}
    }
    assert (await tools.call("run_command", {"command": "true"}))["exit_code"] == 0
    assert [t["name"] for t in tools.schemas("anthropic")] == ["run_command"]


async def test_ask_rule_without_approver_returns_approval_required(sandbox: Sandbox) -> None:
    result = await box(sandbox).call("run_command", {"command": "echo", "args": ["git", "push"]})
    assert result["error"]["code"] == "approval_required"
    assert result["approval"] == {
        "tool": "run_command",
        "command": "echo git push",
        "reason": "publishes commits",
    }


async def test_approver_decides_ask_rules(sandbox: Sandbox) -> None:
    asked: list[ApprovalRequest] = []

    async def approver(request: ApprovalRequest) -> bool:
        asked.append(request)
        return "yes" in (request.command_line or "")

    rules = [Rule(command=r"^echo", outcome="ask")]
    tools = box(sandbox, approver=approver, rules=rules)
    assert (await tools.call("run_command", {"command": "echo yes"}))["stdout"] == "yes\n"
    assert (await tools.call("run_command", {"command": "echo no"}))["error"][
        "code"
    ] == "approval_denied"
    assert [r.command_line for r in asked] == ["echo yes", "echo no"]


async def test_an_approver_that_fails_is_not_a_user_s_no(
    sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    """An approver that cannot reach its human (the approval server is down): the model
    learns that nobody could be asked, with the cause, not that the user declined."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]

    async def approver(request: ApprovalRequest) -> bool:
        await asyncio.open_connection("127.0.0.1", port)  # refused
        return True

    result = await box(sandbox, approver=approver).call("run_command", {"command": "git push"})
    assert result["error"]["code"] == "approval_unavailable", result
    message = result["error"]["message"]
    assert "could not ask a human" in message and "Connect call failed" in message, message
    assert "declined" not in message and "git push" in message
    assert not any(r.exc_info for r in caplog.records)  # one line, no traceback


@pytest.mark.parametrize(
    ("mode", "tool", "arguments", "allowed"),
    [
        ("read-only", "vfs_list", {}, True),
        ("read-only", "run_command", {"command": "true"}, False),
        ("read-only", "vfs_write", {"path": "x", "content": ""}, False),
        ("deny", "vfs_list", {}, False),
        ("auto", "run_command", {"command": "echo git push"}, True),
        ("auto", "run_command", {"command": "echo forbidden"}, False),
    ],
)
async def test_permission_modes(
    sandbox: Sandbox, mode: Any, tool: str, arguments: dict[str, Any], allowed: bool
) -> None:
    rules = [Rule(command="forbidden", outcome="deny"), Rule(command=r"git\s+push", outcome="ask")]
    result = await box(sandbox, permission_mode=mode, rules=rules).call(tool, arguments)
    assert ("error" not in result) is allowed, result


async def test_scopes_parent_reads_child_but_kills_only_own(
    workspace: Path, tmp_path: Path
) -> None:
    child_ws = tmp_path / "child"
    child_ws.mkdir()
    async with Sandbox(workspace=workspace) as parent_sb, Sandbox(workspace=child_ws) as child_sb:
        parent, child = box(parent_sb), box(child_sb)
        parent.add_child_registry("research-agent", child_sb.registry)
        own = await parent.call("run_command", {"command": "echo parent"})
        sleeper = await child.call("run_command", {"command": "sleep 30", "wait": False})
        echo = await child.call("run_command", {"command": "echo child-output"})
        rows = (await parent.call("list_processes", {}))["processes"]
        owners = {(p["owner"], p["pid"]) for p in rows}
        assert owners == {
            ("self", own["pid"]),
            ("research-agent", sleeper["pid"]),
            ("research-agent", echo["pid"]),
        }
        child_rows = (await child.call("list_processes", {}))["processes"]
        assert {p["owner"] for p in child_rows} == {"self"}
        read = await parent.call(
            "read_process_output", {"pid": echo["pid"], "owner": "research-agent"}
        )
        assert read["output"] == "child-output\n"
        assert echo["pid"] != own["pid"]
        denied = await parent.call("kill_process", {"pid": echo["pid"]})
        assert denied["error"]["code"] == "process_not_found"
        assert "sub-agent" in denied["error"]["message"]
        assert (await child.call("kill_process", {"pid": sleeper["pid"]}))["delivered"] is True
        blind = await child.call("read_process_output", {"pid": 10_000})
        assert blind["error"]["code"] == "process_not_found"


async def test_shell_expect_finds_a_confirmation_prompt(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    await tools.call("vfs_write", {"path": "tf.sh", "content": TF_SCRIPT})
    sid = (await tools.call("open_shell", {"shell": "/bin/sh"}))["session_id"]
    await tools.call("shell_write", {"session_id": sid, "input": "sh tf.sh\n"})
    prompt = await tools.call(
        "shell_expect", {"session_id": sid, "pattern": "Enter a value:", "timeout_secs": 5}
    )
    assert prompt["matched"] is True and "Plan: 1 to add" in prompt["output"]
    await tools.call("shell_write", {"session_id": sid, "input": "yes\n"})  # the human's answer
    done = await tools.call(
        "shell_expect", {"session_id": sid, "pattern": "Apply complete!", "timeout_secs": 5}
    )
    assert done["matched"] is True


async def test_shell_expect_cases_responds_with_captures(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    sid = (await tools.call("open_shell", {}))["session_id"]
    await tools.call(
        "shell_write", {"session_id": sid, "input": "echo version 1.42; read v; echo got=$v\n"}
    )
    cases = [
        {"pattern": "password:", "tag": "needs_user", "label": "Password prompt"},
        {
            "pattern": r"version (\d+\.\d+)",
            "tag": "ok",
            "label": "Version detected",
            "respond": "Detected version $1\n",
        },
    ]
    result = await tools.call(
        "shell_expect_cases", {"session_id": sid, "cases": cases, "timeout_secs": 5}
    )
    assert (result["matched"], result["matched_case"], result["tag"], result["label"]) == (
        True,
        1,
        "ok",
        "Version detected",
    )
    assert result["captures"] == ["version 1.42", "1.42"]
    echoed = await tools.call(
        "shell_expect",
        {"session_id": sid, "pattern": "got=Detected version 1.42", "timeout_secs": 5},
    )
    assert echoed["matched"] is True


async def test_shell_batch_runs_send_expect_steps(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    sid = (await tools.call("open_shell", {}))["session_id"]
    steps = [
        {"type": "send", "input": "echo one\n"},
        # Typed before the first prompt, the line is echoed first and "$ " lands before "one".
        # Waiting for the next prompt too keeps "echo two" from racing a prompt the same way.
        {"type": "expect", "pattern": r"^([$#] )?one\r?\n[$#] ", "timeout_secs": 5},  # # as root
        {"type": "send", "input": "echo two\n"},
        {
            "type": "expect_cases",
            "cases": [{"pattern": "^two", "tag": "ok"}, {"pattern": "ERR", "tag": "fail"}],
        },
    ]
    result = await tools.call("shell_batch", {"session_id": sid, "steps": steps, "timeout_secs": 5})
    assert (result["completed"], result["total"]) == (4, 4)
    assert [s["success"] for s in result["steps"]] == [True] * 4
    signalled = await tools.call("shell_signal", {"session_id": sid, "signal": "SIGINT"})
    assert signalled["delivered"] is True


async def test_long_output_is_capped_keeping_head_and_tail(sandbox: Sandbox) -> None:
    tools = box(sandbox, output_chars=1000)
    result = await tools.call("run_command", {"command": "echo HEAD; seq 1 20000; echo TAIL"})
    assert result["truncated"] is True
    assert result["stdout"].startswith("HEAD") and result["stdout"].endswith("TAIL\n")
    assert "chars truncated" in result["stdout"] and len(result["stdout"]) < 1100


def test_schemas_are_generated_for_every_format() -> None:
    openai = tool_schemas(TOOLS, "openai")
    assert {f["function"]["name"] for f in openai} >= {"run_command", "sandbox_exec", "shell_batch"}
    anthropic = {t["name"]: t for t in tool_schemas(TOOLS, "anthropic")}
    exec_schema = anthropic["sandbox_exec"]["input_schema"]
    assert exec_schema["required"] == ["runtime", "code"]
    assert exec_schema["properties"]["runtime"]["enum"] == ["sh", "python3", "node"]
    mcp = {t["name"]: t for t in tool_schemas(TOOLS, "mcp")}
    assert mcp["vfs_read"]["annotations"]["readOnlyHint"] is True
    assert mcp["kill_process"]["annotations"]["destructiveHint"] is True
    assert "$ref" not in str(mcp["shell_batch"]["inputSchema"])


@pytest.fixture
async def unwatched_sandbox(backend_name: str, workspace: Path) -> AsyncIterator[Sandbox]:
    """The schema test's box, without the loop watch. The test's own jsonschema work runs in
    a thread and holds the GIL in extension calls for tens of milliseconds, which the watch
    charged to whatever callback of the box's waited meanwhile (late in a full run, twice in
    a row: "sampled: nothing", 56 ms). How the tools treat the loop is judged by
    test_a_toolbox_builds_nothing_slow_on_the_event_loop and the contract tests."""
    async with Sandbox(backend_policy(backend_name), workspace=workspace) as sb:
        yield sb


async def test_every_tool_result_matches_its_published_output_schema(
    unwatched_sandbox: Sandbox, workspace: Path
) -> None:
    sandbox = unwatched_sandbox
    # Importing jsonschema, building the schemas and validating are the test's own CPU work:
    # done in a thread, so the loop watch judges only corral's code on the loop.
    jsonschema = await asyncio.to_thread(importlib.import_module, "jsonschema")
    tools = box(sandbox, share_shells=False)
    # The Toolbox started building the schemas in a thread (pydantic's long calls hold the
    # GIL): let it finish first, so the steps below are judged on their own.
    from corral.tools import catalog

    await asyncio.to_thread(catalog.warm_schemas_in_background().join, 30)
    listed = await asyncio.to_thread(tools.schemas, "mcp")
    schemas = {t["name"]: t["outputSchema"] for t in listed}
    assert set(schemas) == {t.name for t in TOOLS}
    assert all(s["type"] == "object" for s in schemas.values())
    (workspace / "notes.txt").write_text("hello\n")

    shell = await tools.call("open_shell", {})
    sid = shell["session_id"]
    background = await tools.call("run_command", {"command": "sleep 30", "wait": False})
    calls: list[tuple[str, dict[str, Any]]] = [
        ("run_command", {"command": "echo hi"}),
        ("run_command", {"command": "exit 3"}),
        ("wait_for_process", {"pid": background["pid"], "timeout_ms": 10}),
        ("read_process_output", {"pid": background["pid"]}),
        ("list_processes", {}),
        ("process_stats", {"pid": background["pid"]}),
        ("kill_process", {"pid": background["pid"]}),
        ("wait_for_process", {"pid": background["pid"], "timeout_ms": 5000}),
        ("shell_write", {"session_id": sid, "input": "echo ready-$((1+1))\n"}),
        ("shell_expect", {"session_id": sid, "pattern": "ready-2", "timeout_secs": 10}),
        ("shell_expect", {"session_id": sid, "pattern": "never", "timeout_secs": 0.05}),
        ("shell_read", {"session_id": sid}),
        (
            "shell_expect_cases",
            {"session_id": sid, "cases": [{"pattern": "nope"}], "timeout_secs": 0.05},
        ),
        (
            "shell_batch",
            {
                "session_id": sid,
                "steps": [
                    {"type": "send", "input": "echo v1.2\n"},
                    {"type": "expect_cases", "cases": [{"pattern": r"v(\d)\.(\d)"}]},
                ],
            },
        ),
        ("shell_signal", {"session_id": sid, "signal": "SIGINT"}),
        ("vfs_write", {"path": "out.txt", "content": "x"}),
        ("vfs_list", {"path": "."}),
        ("vfs_read", {"path": "notes.txt"}),
        ("sandbox.exec", {"runtime": "sh", "code": "echo $((6*7))"}),
        ("sandbox_info", {}),
    ]
    seen = {"open_shell"}
    await asyncio.to_thread(jsonschema.validate, shell, schemas["open_shell"])
    results = []
    for name, arguments in calls:
        result = await tools.call(name, arguments)
        assert "error" not in result, (name, result)
        results.append((name, result))
        seen.add(name)

    # jsonschema is pure Python and GIL-bound: validated in one thread after the calls, so the
    # loop watch judges the tools, not the validator's share of the GIL between steps.
    def validate_all() -> None:
        for n, r in results:
            jsonschema.validate(r, schemas[n])

    await asyncio.to_thread(validate_all)
    assert seen == set(schemas)  # every tool was exercised


async def test_failures_share_one_shape(sandbox: Sandbox) -> None:
    tools = box(sandbox)
    for name, arguments in [
        ("no_such_tool", {}),
        ("run_command", {"command": 3}),
        ("kill_process", {"pid": 999_999}),
        ("shell_read", {"session_id": "nope"}),
    ]:
        result = await tools.call(name, arguments)
        assert set(result) <= {"error", "fields"}, result
        assert set(result["error"]) == {"code", "message"}


async def test_a_toolbox_builds_nothing_slow_on_the_event_loop(
    box_policy: Policy, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the loop watch (no callback over 20 ms): a Toolbox with rules and a secrets
    file, its schemas in every format and a call. Building the schemas (pydantic's work,
    milliseconds each) happens once per process, in a thread the first Toolbox starts."""
    from corral.tools import catalog

    catalog._schema_text.cache_clear()  # as in a fresh process
    monkeypatch.setattr(catalog, "_warming", None)
    secrets = tmp_path / "secrets"
    secrets.write_text("api-key=sk-live-123\n")
    policy = box_policy.model_copy(update={"secrets_file": secrets})
    async with Sandbox(policy, workspace=workspace) as sb:
        tools = Toolbox(sb, rules=[Rule(tool="run_command", command=r"\bgit\s+push\b")])
        warming = catalog.warm_schemas_in_background()
        assert warming is catalog.warm_schemas_in_background()  # once per process
        await asyncio.to_thread(warming.join, 30)
        assert catalog._schema_text.cache_info().currsize >= len(TOOLS)
        for fmt in ("openai", "anthropic", "mcp", "mcp"):
            assert len(tools.schemas(fmt)) == len(TOOLS)
        result = await tools.call("run_command", {"command": "echo $K"}, approved=True)
        assert result["exit_code"] == 0
        assert tools.secrets.redact("sk-live-123") == "[REDACTED:api-key]"


async def test_bytes_that_are_not_utf8_are_said_and_a_binary_file_goes_back_whole(
    sandbox: Sandbox,
) -> None:
    """Output bytes shown as U+FFFD are flagged (not_utf8), and a binary file vfs_read
    returned (base64) can be written back as it was (vfs_write took text only)."""
    tools = box(sandbox)
    got = await tools.call("run_command", {"command": "printf", "args": ["caf\\351\\n"]})
    assert (got["stdout"], got.get("not_utf8")) == ("caf\ufffd\n", True), got
    assert "not_utf8" not in await tools.call("run_command", {"command": "echo", "args": ["ok"]})
    blob = bytes(range(256)) * 4
    await sandbox.files.write("blob.bin", blob)
    read = await tools.call("vfs_read", {"path": "blob.bin"})
    assert read["encoding"] == "base64"
    written = await tools.call(
        "vfs_write", {"path": "copy.bin", "content": read["content"], "encoding": "base64"}
    )
    assert written["size"] == len(blob), written
    assert await sandbox.files.read("copy.bin") == blob
    bad = await tools.call("vfs_write", {"path": "x", "content": "no!", "encoding": "base64"})
    assert bad["error"]["code"] == "invalid_input", bad
    assert not await sandbox.files.exists("x")
