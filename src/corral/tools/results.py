"""What each tool returns: one pydantic model per tool, in the spec's JSON shapes.

A result's JSON is exactly the fields that were given (``exclude_unset``): a field a handler
leaves out is absent, one it sets to ``None`` is ``null``. That is how the spec's shapes read
(``oom_killed`` only when true, ``exit_code: null`` for a running process), and it lets a
result model be published as the tool's MCP ``outputSchema``: fields that are always there are
``required``, the others are optional.

Failures have one shape for every tool, :class:`ToolError` (``{"error": {"code", "message"}}``
plus ``fields`` for bad input or ``approval`` for a call that needs a human).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.models import Ending

__all__ = [
    "Approval",
    "BatchStepResult",
    "ErrorInfo",
    "ExpectCasesResult",
    "ExpectResult",
    "KillProcessResult",
    "ListProcessesResult",
    "NetworkRefusalResult",
    "OpenShellResult",
    "ProcessRow",
    "ProcessStatsResult",
    "ReadProcessOutputResult",
    "RunCommandResult",
    "SandboxExecResult",
    "SandboxInfoResult",
    "ShellBatchResult",
    "ShellReadResult",
    "ShellSignalResult",
    "ShellWriteResult",
    "ToolError",
    "ToolResult",
    "VfsEntry",
    "VfsListResult",
    "VfsReadResult",
    "VfsWriteResult",
    "WaitForProcessResult",
]


class ToolResult(BaseModel):
    """Base of every tool result; see the module docstring for which fields the JSON has."""

    truncated: bool | None = Field(
        default=None,
        description="Set (true) when long strings in this result were cut, keeping head and tail.",
    )
    not_utf8: bool | None = Field(
        default=None,
        description="Set (true) when output in this result had bytes that are not UTF-8, "
        "shown as U+FFFD; vfs_read a file for its exact bytes (base64).",
    )

    def to_json(self) -> dict[str, Any]:
        """The tool's JSON result (the fields that were given)."""
        return self.model_dump(mode="json", exclude_unset=True)


class _Part(BaseModel):
    """A nested object of a result (same rule: the fields that were given)."""


class ErrorInfo(_Part):
    code: str = Field(description="A stable error code (corral.ErrorCode values and a few more).")
    message: str = Field(description="One sentence naming the cause and what to do.")


class Approval(_Part):
    tool: str
    command: str
    reason: str | None = None


class ToolError(ToolResult):
    """A failed call: the model reads the message and corrects itself."""

    error: ErrorInfo
    fields: list[str] | None = Field(default=None, description="Paths of the invalid fields.")
    approval: Approval | None = Field(default=None, description="What needs a human's approval.")

    @classmethod
    def of(cls, code: str, message: str) -> ToolError:
        return cls(error=ErrorInfo(code=code, message=message))


class NetworkRefusalResult(_Part):
    host: str
    port: int
    protocol: str
    status: int
    reason: str


class RunCommandResult(ToolResult):
    """``wait=true``: pid, exit_code, ended, timed_out, timeout_secs, stdout, stderr.
    ``wait=false``: pid, ``status: "running"`` and a hint."""

    pid: int
    status: Literal["running"] | None = None
    hint: str | None = None
    exit_code: int | None = Field(
        default=None, description="The exit status; -N when a signal N ended the command."
    )
    ended: Ending | None = Field(
        default=None,
        description="How the command ended: exited (by itself, any status), signalled, "
        "timed_out (SIGTERM, then SIGKILL after the policy's grace), oom_killed, lost (the "
        "sandbox died).",
    )
    timed_out: bool | None = None
    timeout_secs: float | None = Field(
        default=None,
        description="The timeout in effect: the call's timeout_secs, else the policy's "
        "exec_timeout_secs, else the tool's default.",
    )
    stdout: str | None = None
    stderr: str | None = None
    oom_killed: bool | None = Field(default=None, description="Present (true) after an OOM kill.")
    network_refusals: list[NetworkRefusalResult] | None = None


class WaitForProcessResult(ToolResult):
    pid: int
    status: Literal["exited", "timeout"]
    exit_code: int | None = None
    message: str | None = None


class ReadProcessOutputResult(ToolResult):
    pid: int
    stream: Literal["stdout", "stderr"]
    status: Literal["running", "exited"]
    owner: str | None = Field(default=None, description="Present for a sub-agent's process.")
    exit_code: int | None = None
    output: str


class ProcessRow(_Part):
    owner: str
    pid: int
    command: str
    status: Literal["running", "exited"]
    exit_code: int | None
    duration_secs: float


class ListProcessesResult(ToolResult):
    processes: list[ProcessRow]


class KillProcessResult(ToolResult):
    pid: int
    signal: str
    delivered: bool


class ProcessStatsResult(ToolResult):
    pid: int
    status: str
    cpu_seconds: float
    rss_bytes: int
    processes: int


class OpenShellResult(ToolResult):
    session_id: str
    shell: str
    hint: str


class ShellWriteResult(ToolResult):
    session_id: str
    written: int


class ShellReadResult(ToolResult):
    session_id: str
    output: str


class ExpectResult(ToolResult):
    matched: bool
    pattern: str
    output: str
    captures: list[str]
    reason: Literal["timeout", "eof"] | None = Field(
        default=None, description="Why nothing matched (present only when matched is false)."
    )
    dropped_chars: int | None = Field(
        default=None, description="Output lost at the start because the buffer overflowed."
    )


class ExpectCasesResult(ExpectResult):
    matched_case: int | None
    tag: str | None
    label: str | None


class BatchStepResult(_Part):
    index: int
    step_type: Literal["send", "expect", "expect_cases"]
    success: bool
    output: str | None = None
    captures: list[str] | None = None
    matched_case: int | None = None
    tag: str | None = None
    label: str | None = None
    error: str | None = None


class ShellBatchResult(ToolResult):
    steps: list[BatchStepResult]
    completed: int
    total: int


class ShellSignalResult(ToolResult):
    session_id: str
    signal: str
    delivered: bool


class VfsEntry(_Part):
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    name_escaped: bool | None = Field(
        default=None,
        description="Present (true) when the name is not UTF-8: name shows it with \\xNN "
        "escapes and name_base64 holds its exact bytes.",
    )
    name_base64: str | None = None


class VfsListResult(ToolResult):
    path: str
    entries: list[VfsEntry]
    total_entries: int | None = Field(default=None, description="Present when entries is cut.")


class VfsReadResult(ToolResult):
    path: str
    size: int
    """Size of the whole file."""
    binary: bool | None = Field(default=None, description="Present (true) for binary content.")
    encoding: Literal["utf-8", "base64"] = Field(
        default="utf-8", description="base64 for binary content (not UTF-8, or NUL bytes)."
    )
    content: str
    offset: int = 0
    length: int | None = Field(default=None, description="Bytes returned (with offset/limit).")
    eof: bool | None = Field(default=None, description="True when the read reached the end.")


class VfsWriteResult(ToolResult):
    path: str
    size: int


class SandboxExecResult(ToolResult):
    stdout: str
    stderr: str
    exit_code: int
    error: ErrorInfo | None = Field(default=None, description="Present when the code timed out.")


class SandboxInfoResult(ToolResult):
    """The box as its agent and backend describe it; backends add fields of their own."""

    model_config = ConfigDict(extra="allow")

    backend: str
    workspace: str
    tools: list[str]
    kernel: str | None = None
    hostname: str | None = None
    arch: str | None = None
    cpus: int | None = None
    memory_bytes: int | None = None
    sandbox_id: str | None = None
    workdir: str | None = None
