"""Input models of the agent tools: one pydantic model per tool, JSON Schema derived from it.

Every model forbids unknown fields and is strict (``"5"`` is not an integer), so a model's
mistake is reported naming the field instead of being guessed at. Sizes are bounded so a
runaway input cannot exhaust the host. Descriptions are written for the model reading them.
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corral import errors
from corral.processes import parse_signal
from corral.sessions.expect import Case

MAX_COMMAND = 65_536
MAX_TEXT = 1_000_000
MAX_PATTERN = 4_096
MAX_NAME = 256
MAX_ITEMS = 1_024
MAX_PID = 2**31 - 1
MAX_TIMEOUT_SECS = 3_600

Text = Annotated[str, Field(max_length=MAX_TEXT)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=MAX_NAME)]
Pid = Annotated[int, Field(ge=1, le=MAX_PID, description="Process id from run_command.")]
SessionId = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME, description="Session id from open_shell.")
]
Signal = Annotated[
    str, Field(min_length=1, max_length=32, description="Signal name such as SIGINT or SIGTERM.")
]
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_SECS)]


def check_regex(pattern: str) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # e.g. "Possible nested set"
            re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None
    return pattern


def check_signal(sig: str) -> str:
    try:
        parse_signal(sig)
    except errors.SandboxError as exc:
        raise ValueError(exc.message) from None
    return sig


Pattern = Annotated[
    str,
    Field(min_length=1, max_length=MAX_PATTERN, description="Python regular expression."),
]


class ToolArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RunCommandArgs(ToolArgs):
    command: str = Field(
        min_length=1,
        max_length=MAX_COMMAND,
        description="Program to run (e.g. 'cargo'). With no args it is a shell command line "
        "run by /bin/sh -c, so pipes and && work.",
    )
    args: list[Annotated[str, Field(max_length=MAX_COMMAND)]] = Field(
        default_factory=list, max_length=MAX_ITEMS, description="Arguments, one per element."
    )
    wait: bool = Field(
        default=True,
        description="true: wait for exit and return output (compile, lint, format). false: "
        "return a pid at once and poll with wait_for_process / read_process_output.",
    )
    timeout_secs: Seconds | None = Field(
        default=None,
        description="With wait=true: kill the command after this many seconds (default: the "
        "sandbox policy's limits.exec_timeout_secs, else 60).",
    )
    cwd: str | None = Field(
        default=None, max_length=4_096, description="Working directory (default: workspace)."
    )
    env: dict[EnvName, Annotated[str, Field(max_length=MAX_COMMAND)]] | None = Field(
        default=None,
        max_length=MAX_ITEMS,
        description="Extra environment. A value may be a secret handle '{{secret:NAME}}'.",
    )


class WaitForProcessArgs(ToolArgs):
    pid: Pid
    timeout_ms: int = Field(
        default=30_000, ge=0, le=MAX_TIMEOUT_SECS * 1000, description="How long to block."
    )


class ReadProcessOutputArgs(ToolArgs):
    pid: Pid
    stream: Literal["stdout", "stderr"] = Field(default="stdout")
    owner: Name | None = Field(
        default=None,
        description="Whose process: 'self' or a sub-agent name from list_processes. "
        "Needed only when two owners have the same pid.",
    )


class ListProcessesArgs(ToolArgs):
    pass


class KillProcessArgs(ToolArgs):
    pid: Pid
    signal: Signal = "SIGKILL"

    _signal = field_validator("signal")(check_signal)


class ProcessStatsArgs(ToolArgs):
    pid: Pid
    owner: Name | None = None


class OpenShellArgs(ToolArgs):
    shell: str = Field(
        default="/bin/sh", min_length=1, max_length=4_096, description="Shell program."
    )


class ShellWriteArgs(ToolArgs):
    session_id: SessionId
    input: Text = Field(description="Keystrokes; end a command with \\n. \\u0003 is Ctrl-C.")


class ShellReadArgs(ToolArgs):
    session_id: SessionId


class ShellExpectArgs(ToolArgs):
    session_id: SessionId
    pattern: Pattern
    timeout_secs: Seconds = 30

    _pattern = field_validator("pattern")(check_regex)


class CaseArgs(ToolArgs):
    pattern: Pattern
    tag: Name | None = Field(default=None, description="Your label for flow control, e.g. 'ok'.")
    label: str | None = Field(default=None, max_length=MAX_PATTERN)
    respond: str | None = Field(
        default=None,
        max_length=MAX_TEXT,
        description="Sent back when this case matches; $1, $2 insert capture groups.",
    )

    _pattern = field_validator("pattern")(check_regex)

    @field_validator("respond")
    @classmethod
    def _check_respond(cls, respond: str | None, info: Any) -> str | None:
        pattern = info.data.get("pattern")
        if respond is not None and pattern is not None:
            try:
                Case(pattern, respond=respond)
            except errors.SandboxError as exc:
                raise ValueError(exc.message) from None
        return respond


Cases = Annotated[list[CaseArgs], Field(min_length=1, max_length=64)]


class ShellExpectCasesArgs(ToolArgs):
    session_id: SessionId
    cases: Cases
    timeout_secs: Seconds = 30


class SendStep(ToolArgs):
    type: Literal["send"]
    input: Text


class ExpectStep(ToolArgs):
    type: Literal["expect"]
    pattern: Pattern
    timeout_secs: Seconds | None = None

    _pattern = field_validator("pattern")(check_regex)


class ExpectCasesStep(ToolArgs):
    type: Literal["expect_cases"]
    cases: Cases
    timeout_secs: Seconds | None = None


Step = Annotated[SendStep | ExpectStep | ExpectCasesStep, Field(discriminator="type")]


class ShellBatchArgs(ToolArgs):
    session_id: SessionId
    steps: list[Step] = Field(min_length=1, max_length=256)
    timeout_secs: Seconds = Field(default=30, description="Default timeout of each expect step.")


class ShellSignalArgs(ToolArgs):
    session_id: SessionId
    signal: Signal = "SIGINT"

    _signal = field_validator("signal")(check_signal)


class VfsListArgs(ToolArgs):
    path: str = Field(default=".", min_length=1, max_length=4_096)


class VfsReadArgs(ToolArgs):
    path: str = Field(min_length=1, max_length=4_096)
    offset: int = Field(default=0, ge=0, description="First byte to read.")
    limit: int | None = Field(
        default=None,
        gt=0,
        le=8 << 20,
        description="Bytes to read from offset (at most 8 MiB). Without it the whole file, "
        "which must then be at most 8 MiB.",
    )


class VfsWriteArgs(ToolArgs):
    path: str = Field(min_length=1, max_length=4_096)
    content: Text
    append: bool = False
    encoding: Literal["utf-8", "base64"] = Field(
        default="utf-8",
        description="How content is given: text, or base64 for bytes (as vfs_read returns "
        "a binary file), so a file read can be written back as it was.",
    )


class SandboxExecArgs(ToolArgs):
    runtime: Literal["sh", "python3", "node"] = Field(description="The runtime to run code in.")
    code: Text = Field(description="The code or script to execute.")
    stdin: Text | None = Field(default=None, description="Optional data piped to stdin.")
    timeout_ms: int = Field(
        default=5_000, ge=1, le=MAX_TIMEOUT_SECS * 1000, description="Killed after this."
    )
    secrets: dict[EnvName, Annotated[str, Field(max_length=MAX_NAME)]] | None = Field(
        default=None,
        max_length=64,
        description="Env var name -> secret handle '{{secret:NAME}}'. Values never reach you.",
    )


class SandboxInfoArgs(ToolArgs):
    pass
