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

Every path by which text reaches a shell passes the same gate: ``shell_write``, the ``send``
steps of ``shell_batch`` and the ``respond`` text of ``shell_expect_cases`` cases (also inside
batch steps). In ``read-only`` mode none of them runs. A command regex is searched in the text
as given *and* in each simple command it contains after normalising (see
:func:`command_variants`): line continuations joined, split on ``; && || | &`` and newlines,
quotes removed, ``VAR=value`` prefixes and wrappers (``env``, ``command``, ``exec``, ``nohup``,
``time``, ``sudo``) dropped, ``/usr/bin/git`` read as ``git``, the options of ``git``,
``terraform`` and ``kubectl`` before the subcommand dropped, ``rm``'s flags joined (``rm -r -f``
is ``rm -rf``), and ``sh -c '...'`` looked into.
A rule is a tripwire for the spellings it can see, not a promise: a shell can build a command
at runtime (``$(printf 'gi%s' t) push``, a script written to a file first, an alias).
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
        if command_line is None:
            return False
        pattern = re.compile(self.command)
        return any(pattern.search(text) for text in command_variants(command_line))


_SEPARATORS = re.compile(r"&&|\|\||;;?|\|&?|&|\n|\(|\)|`|\$\(")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_WRAPPERS = frozenset({"env", "command", "exec", "nohup", "time", "sudo", "doas", "builtin"})
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})
_MAX_DEPTH = 4


def _split_commands(text: str) -> list[str]:
    """Simple commands of a shell line: separators outside quotes end a command."""
    parts: list[str] = []
    current: list[str] = []
    quote = ""
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            current.append(ch)
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"' and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
            i += 1
            continue
        if ch in "'\"":
            quote = ch
            current.append(ch)
            i += 1
            continue
        if ch == "\\" and i + 1 < len(text):
            current.append(text[i : i + 2])
            i += 2
            continue
        found = _SEPARATORS.match(text, i)
        if found:
            parts.append("".join(current))
            current = []
            i = found.end()
            continue
        current.append(ch)
        i += 1
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unclosed quote: still look at what is there
        return command.replace("'", " ").replace('"', " ").split()


def _normalise(words: list[str], depth: int) -> list[str]:
    """The simple command as it will run, plus what ``sh -c`` would run inside it."""
    while words and (_ASSIGNMENT.match(words[0]) or words[0].rsplit("/", 1)[-1] in _WRAPPERS):
        words = words[1:]
        while words and words[0].startswith("-") and words[0] != "-c":  # env -i, sudo -u x
            words = words[1:]
    if not words:
        return []
    program = words[0].rsplit("/", 1)[-1] or words[0]
    words = [program, *words[1:]]
    out = [" ".join(words)]
    canonical = _canonical(words)
    if canonical is not None and canonical != words:
        out.append(" ".join(canonical))
    if program in _SHELLS and depth < _MAX_DEPTH:
        rest = words[1:]
        if program == "busybox" and rest and rest[0] in _SHELLS:
            rest = rest[1:]
        for index, word in enumerate(rest):
            if word == "-c" or (word.startswith("-") and not word.startswith("--") and "c" in word):
                if index + 1 < len(rest):
                    out.extend(_variants(rest[index + 1], depth + 1))
                break
    return out


# Options a tool takes before its subcommand whose value is the next word (``git -C dir
# push``); other leading options are single words (``--no-pager``, ``-chdir=x``).
_GLOBAL_VALUE_OPTIONS: dict[str, frozenset[str]] = {
    "git": frozenset(
        {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env", "--exec-path"}
    ),
    "terraform": frozenset(),
    "kubectl": frozenset(
        {
            "-n",
            "--namespace",
            "--context",
            "--kubeconfig",
            "--cluster",
            "--user",
            "-s",
            "--server",
            "--as",
            "--as-group",
            "--token",
            "--request-timeout",
            "-v",
            "--v",
        }
    ),
}
_RM_LONG = {"--recursive": "r", "--force": "f", "--dir": "d", "--verbose": "v"}


def _canonical(words: list[str]) -> list[str] | None:
    """The spelling the rules are written for, when ``words`` say the same otherwise:
    ``git -C . push`` / ``kubectl -n prod delete`` / ``terraform -chdir=x apply`` with the
    global options before the subcommand dropped; ``rm -r -f`` / ``rm --recursive --force``
    with the flags joined as ``rm -rf``."""
    program, rest = words[0], words[1:]
    if program in _GLOBAL_VALUE_OPTIONS:
        takes_value = _GLOBAL_VALUE_OPTIONS[program]
        i = 0
        while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
            i += 2 if rest[i] in takes_value else 1
        return [program, *rest[i:]]
    if program == "rm":
        letters, operands = [], []
        for word in rest:
            if word.startswith("--") and word != "--":
                letters.append(_RM_LONG.get(word, ""))
            elif word.startswith("-") and len(word) > 1 and word != "--":
                letters.append(word[1:])
            else:
                operands.append(word)
        flags = "".join(letters)
        return [program, *([f"-{flags}"] if flags else []), *operands]
    return None


def _variants(text: str, depth: int) -> list[str]:
    out: list[str] = []
    for command in _split_commands(text):
        out.extend(_normalise(_words(command), depth))
    return out


def command_variants(text: str) -> list[str]:
    """``text`` itself, then each simple command in it, normalised (what rules search).

    ``"FOO=1 /usr/bin/git  'push' && sh -c 'rm -rf /'"`` gives the text, ``git push``,
    ``sh -c rm -rf /`` and ``rm -rf /``.
    """
    joined = re.sub(r"\\\r?\n", "", text)
    out = [text]
    for variant in [joined, *_variants(joined, 0)]:
        if variant not in out:
            out.append(variant)
    return out


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


def _responds(cases: Any) -> list[str]:
    if not isinstance(cases, list):
        return []
    return [str(c["respond"]) for c in cases if isinstance(c, dict) and c.get("respond")]


def typed_text(tool: str, arguments: dict[str, Any]) -> list[str]:
    """Every piece of text the call may type into a shell, in order (empty: types nothing).

    A ``respond`` may insert capture groups (``$1``) from the box's output: the text that is
    typed can then hold words no rule saw.
    """
    if tool == "shell_write":
        return [str(arguments.get("input", ""))]
    if tool == "shell_expect_cases":
        return _responds(arguments.get("cases"))
    if tool == "shell_batch":
        out: list[str] = []
        for step in arguments.get("steps") or []:
            if not isinstance(step, dict):
                continue
            if step.get("type") == "send":
                out.append(str(step.get("input", "")))
            out.extend(_responds(step.get("cases")))
        return out
    return []


def command_line(tool: str, arguments: dict[str, Any]) -> str | None:
    """The text rules match against: what the call would run or type."""
    if tool == "run_command":
        args = arguments.get("args") or []
        cmd = str(arguments.get("command", ""))
        return shlex.join([cmd, *map(str, args)]) if args else cmd
    if tool == "sandbox.exec":
        return str(arguments.get("code", ""))
    if tool in ("shell_write", "shell_expect_cases", "shell_batch"):
        typed = typed_text(tool, arguments)
        # Each piece on its own line: a rule matches one command, never a seam between two.
        return "\n".join(typed) if typed else None
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
        if self.mode == "read-only" and typed_text(tool, arguments):
            return Verdict(
                "deny", f"permission mode 'read-only' types nothing into a shell ({tool})"
            )
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
