"""The tool catalogue: each tool's name, input and result models, description, and hints.

The descriptions carry the spec's "when to use each mode" advice, because the model reads
nothing else before choosing a tool.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from corral.tools import results as r
from corral.tools.schemas import (
    KillProcessArgs,
    ListProcessesArgs,
    OpenShellArgs,
    ProcessStatsArgs,
    ReadProcessOutputArgs,
    RunCommandArgs,
    SandboxExecArgs,
    SandboxInfoArgs,
    ShellBatchArgs,
    ShellExpectArgs,
    ShellExpectCasesArgs,
    ShellReadArgs,
    ShellSignalArgs,
    ShellWriteArgs,
    ToolArgs,
    VfsListArgs,
    VfsReadArgs,
    VfsWriteArgs,
    WaitForProcessArgs,
)

_WHEN = (
    " When to use what: compile/lint/format -> run_command(wait=true); test suite or long "
    "build -> run_command(wait=false) then wait_for_process / read_process_output; a CLI that "
    "prompts -> open_shell + shell_expect; several possible outcomes -> shell_expect_cases; a "
    "scripted send/expect flow -> shell_batch; reading or writing files -> vfs_* tools."
)


class ToolSpec(BaseModel):
    """One tool: its name, input and result models, description and behaviour hints."""

    model_config = ConfigDict(frozen=True)

    name: str
    args: type[ToolArgs]
    result: type[r.ToolResult]
    """What a successful call returns (failures are :class:`~corral.tools.results.ToolError`)."""
    description: str
    read_only: bool
    destructive: bool = False


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="run_command",
        args=RunCommandArgs,
        result=r.RunCommandResult,
        read_only=False,
        destructive=True,
        description="Run a command in the sandbox. wait=true (default) blocks until it exits "
        "and returns pid, exit_code, ended (exited, signalled, timed_out, oom_killed, lost), "
        "timed_out, timeout_secs (the timeout in effect), stdout, stderr: one call, one answer. "
        "wait=false "
        "returns {pid, status: 'running'} at once for long jobs." + _WHEN,
    ),
    ToolSpec(
        name="wait_for_process",
        args=WaitForProcessArgs,
        result=r.WaitForProcessResult,
        read_only=True,
        description="Block until a background process exits or timeout_ms passes. Returns "
        "status 'exited' with exit_code, or status 'timeout' (it keeps running).",
    ),
    ToolSpec(
        name="read_process_output",
        args=ReadProcessOutputArgs,
        result=r.ReadProcessOutputResult,
        read_only=True,
        description="Read the captured stdout or stderr of a process, also while it is still "
        "running (partial output shows progress). Long output keeps its head and tail.",
    ),
    ToolSpec(
        name="list_processes",
        args=ListProcessesArgs,
        result=r.ListProcessesResult,
        read_only=True,
        description="List running and recently finished processes (yours and your "
        "sub-agents'), with pid, command, status and exit_code.",
    ),
    ToolSpec(
        name="kill_process",
        args=KillProcessArgs,
        result=r.KillProcessResult,
        read_only=False,
        destructive=True,
        description="Send a signal (default SIGKILL) to one of your own processes and its "
        "process group.",
    ),
    ToolSpec(
        name="process_stats",
        args=ProcessStatsArgs,
        result=r.ProcessStatsResult,
        read_only=True,
        description="CPU seconds, memory (rss_bytes) and status of a process.",
    ),
    ToolSpec(
        name="open_shell",
        args=OpenShellArgs,
        result=r.OpenShellResult,
        read_only=False,
        description="Start an interactive shell on a terminal (PTY). Use it for programs that "
        "prompt (confirmations, passwords, REPLs). Returns a session_id.",
    ),
    ToolSpec(
        name="shell_write",
        args=ShellWriteArgs,
        result=r.ShellWriteResult,
        read_only=False,
        destructive=True,
        description="Send keystrokes to a shell session; end commands with \\n. Use shell_read "
        "or shell_expect to see the result.",
    ),
    ToolSpec(
        name="shell_read",
        args=ShellReadArgs,
        result=r.ShellReadResult,
        read_only=True,
        description="Return what the shell printed since the last read or match, without "
        "waiting. Prefer shell_expect when you know what to wait for.",
    ),
    ToolSpec(
        name="shell_expect",
        args=ShellExpectArgs,
        result=r.ExpectResult,
        read_only=True,
        description="Wait until a regex appears in the shell's output (no polling loop needed) "
        "and return the output up to it with capture groups. If it is a confirmation or "
        "password prompt, hand the terminal to the user instead of answering it yourself.",
    ),
    ToolSpec(
        name="shell_expect_cases",
        args=ShellExpectCasesArgs,
        result=r.ExpectCasesResult,
        read_only=True,
        description="Wait for the first of several regex cases (switch/case). Returns the "
        "matched case index, its tag and label; a case's respond text is sent automatically.",
    ),
    ToolSpec(
        name="shell_batch",
        args=ShellBatchArgs,
        result=r.ShellBatchResult,
        read_only=False,
        destructive=True,
        description="Run a sequence of send / expect / expect_cases steps in one call. Stops "
        "at the first failed step and returns the partial results.",
    ),
    ToolSpec(
        name="shell_signal",
        args=ShellSignalArgs,
        result=r.ShellSignalResult,
        read_only=False,
        destructive=True,
        description="Send a signal to the shell's foreground program: SIGINT is Ctrl-C.",
    ),
    ToolSpec(
        name="vfs_list",
        args=VfsListArgs,
        result=r.VfsListResult,
        read_only=True,
        description="List a directory in the sandbox workspace (name, type, size).",
    ),
    ToolSpec(
        name="vfs_read",
        args=VfsReadArgs,
        result=r.VfsReadResult,
        read_only=True,
        description="Read a text file from the sandbox workspace.",
    ),
    ToolSpec(
        name="vfs_write",
        args=VfsWriteArgs,
        result=r.VfsWriteResult,
        read_only=False,
        destructive=True,
        description="Write (or append to) a file in the sandbox workspace, creating parents.",
    ),
    ToolSpec(
        name="sandbox.exec",
        args=SandboxExecArgs,
        result=r.SandboxExecResult,
        read_only=False,
        description="Run a snippet of sh, python3 or node code in the sandbox (no network) and "
        "return stdout, stderr, exit_code. A non-zero exit_code is a result: read stderr.",
    ),
    ToolSpec(
        name="sandbox_info",
        args=SandboxInfoArgs,
        result=r.SandboxInfoResult,
        read_only=True,
        description="Describe the sandbox: kernel, cpus, memory, limits, workspace, and the "
        "host address of each published box port (a server there is what the user can reach).",
    ),
)

TOOLS_BY_NAME: dict[str, ToolSpec] = {t.name: t for t in TOOLS}


def function_name(name: str) -> str:
    """OpenAI and Anthropic allow only [a-zA-Z0-9_-] in names: 'sandbox.exec' -> 'sandbox_exec'."""
    return name.replace(".", "_")


def input_schema(args: type[ToolArgs]) -> dict[str, Any]:
    """A self-contained JSON Schema (no $ref) for a tool's input (a fresh copy)."""
    loaded: dict[str, Any] = json.loads(_schema_text(args))
    return loaded


def output_schema(result: type[r.ToolResult]) -> dict[str, Any]:
    """A self-contained JSON Schema (no $ref) for a tool's successful result (MCP's
    ``outputSchema``): the fields always present are ``required``. A fresh copy."""
    loaded: dict[str, Any] = json.loads(_schema_text(result))
    return loaded


def warm_schemas() -> None:
    """Build every tool's schemas now (about 15 ms of pydantic work, once per process), so
    that no later ``schemas()`` on an event loop pays for it. Safe in a thread."""
    for spec in TOOLS:
        for model in (spec.args, spec.result):
            _schema_text(model)
            # pydantic builds a schema in long calls that keep the GIL: let an event loop
            # in another thread (the caller's) run between models, not after all of them.
            time.sleep(0)


_warming: threading.Thread | None = None


def warm_schemas_in_background() -> threading.Thread:
    """:func:`warm_schemas` in a thread of its own, started once per process (a
    ``Toolbox`` starts it, so its ``schemas()`` on an event loop find them built)."""
    global _warming
    if _warming is None:
        _warming = threading.Thread(target=warm_schemas, name="corral-schemas", daemon=True)
        _warming.start()
    return _warming


@functools.cache
def _schema_text(model: type[BaseModel]) -> str:
    """Schemas are built once per model and kept as JSON text: a copy is one parse (tens of
    microseconds), building one is pydantic's schema generation (milliseconds)."""
    return json.dumps(_self_contained(model))


def _self_contained(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})
    cleaned: dict[str, Any] = _clean(schema, defs)
    return cleaned


def _clean(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _clean(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        # Refs are inlined, so the discriminator's ref mapping would dangle; oneOf + const
        # say the same thing to every validator.
        return {k: _clean(v, defs) for k, v in node.items() if k not in ("title", "discriminator")}
    if isinstance(node, list):
        return [_clean(v, defs) for v in node]
    return node
