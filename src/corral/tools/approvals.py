"""Approval gates: which tool calls run, which need a human's yes, which never run.

A :class:`Rule` matches a tool name (glob) and optionally the call's command line (regex)
and says ``allow``, ``ask`` or ``deny``. The permission mode decides what the rules mean:

========== ==================================================================
default    matched rules apply (``ask`` goes to the approver); unmatched: allow
auto       everything runs except what a ``deny`` rule matches
read-only  only tools that change nothing; ``deny`` rules still apply
deny       nothing runs
========== ==================================================================

When several rules match, the strictest outcome wins (deny > ask > allow), so adding an
``allow`` rule can never silently undo a ``deny``.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corral.tools.catalog import TOOLS_BY_NAME
from corral.tools.schemas import check_regex

Outcome = Literal["allow", "ask", "deny"]
PermissionMode = Literal["default", "auto", "read-only", "deny"]
MODES: tuple[PermissionMode, ...] = ("default", "auto", "read-only", "deny")
_SEVERITY: dict[Outcome, int] = {"allow": 0, "ask": 1, "deny": 2}


class Rule(BaseModel):
    """``Rule(tool="run_command", command=r"\\bgit\\s+push\\b", outcome="ask")``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: str = "*"
    """Glob over tool names: ``run_command``, ``shell_*``, ``*``."""
    command: str | None = None
    """Regex searched in the call's command line; None matches every call of the tool."""
    outcome: Outcome = "ask"
    reason: str = Field(default="", max_length=500)
    """Shown to the human (and the model) when the rule fires."""

    @field_validator("command")
    @classmethod
    def _check_command(cls, value: str | None) -> str | None:
        return check_regex(value) if value is not None else None

    def matches(self, tool: str, command_line: str | None) -> bool:
        if not fnmatch.fnmatchcase(tool, self.tool):
            return False
        if self.command is None:
            return True
        return command_line is not None and re.search(self.command, command_line) is not None


# What a careful operator asks about by default: irreversible or outward-facing actions.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        command=r"\brm\s+(-[a-zA-Z]*[rR][a-zA-Z]*f|-[a-zA-Z]*f[a-zA-Z]*[rR])\b",
        reason="recursive forced delete",
    ),
    Rule(command=r"\bgit\s+push\b", reason="publishes commits"),
    Rule(command=r"\bterraform\s+(apply|destroy)\b", reason="changes infrastructure"),
    Rule(command=r"\bkubectl\s+delete\b", reason="deletes cluster resources"),
)


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What the approver (a human, through some UI) is asked about."""

    tool: str
    command_line: str | None
    reason: str
    arguments: dict[str, Any] = field(repr=False)

    def describe(self) -> str:
        what = f"{self.tool}: {self.command_line}" if self.command_line else self.tool
        return f"Allow {what}?" + (f" ({self.reason})" if self.reason else "")


Approver = Callable[[ApprovalRequest], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reason: str


def command_line(tool: str, arguments: dict[str, Any]) -> str | None:
    """The text rules match against: what the call would run or type."""
    if tool == "run_command":
        args = arguments.get("args") or []
        cmd = str(arguments.get("command", ""))
        return shlex.join([cmd, *map(str, args)]) if args else cmd
    if tool == "sandbox.exec":
        return str(arguments.get("code", ""))
    if tool == "shell_write":
        return str(arguments.get("input", ""))
    if tool == "shell_batch":
        steps = arguments.get("steps") or []
        return "".join(str(s.get("input", "")) for s in steps if isinstance(s, dict))
    if tool.startswith("vfs_"):
        return str(arguments.get("path", ""))
    return None


class Gate:
    """Rules plus a permission mode: ``verdict(tool, arguments)``."""

    def __init__(
        self, mode: PermissionMode = "default", rules: tuple[Rule, ...] | list[Rule] | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown permission mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode = mode
        self.rules = tuple(DEFAULT_RULES if rules is None else rules)

    def verdict(self, tool: str, arguments: dict[str, Any]) -> Verdict:
        if self.mode == "deny":
            return Verdict("deny", "permission mode 'deny' allows no tool calls")
        spec = TOOLS_BY_NAME.get(tool)
        if self.mode == "read-only" and (spec is None or not spec.read_only):
            return Verdict("deny", f"permission mode 'read-only' does not allow {tool}")
        line = command_line(tool, arguments)
        worst: Rule | None = None
        for rule in self.rules:
            if rule.matches(tool, line) and (
                worst is None or _SEVERITY[rule.outcome] > _SEVERITY[worst.outcome]
            ):
                worst = rule
        if worst is None:
            return Verdict("allow", "")
        if self.mode in ("auto", "read-only") and worst.outcome != "deny":
            return Verdict("allow", "")
        return Verdict(worst.outcome, worst.reason or f"matches rule for {worst.tool}")
