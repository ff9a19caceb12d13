"""``Toolbox``: the agent-facing tool contract over one sandbox.

::

    async with Sandbox() as sb:
        tools = Toolbox(sb, capabilities={"run_command", "sandbox.exec"})
        openai_tools = tools.schemas("openai")
        result = await tools.call("run_command", {"command": "ls"})

:meth:`Toolbox.call` never raises: invalid input, a capability the caller lacks, a gate
that says no, an unknown pid and a bug alike come back as ``{"error": {"code", "message"}}``
for the model to read. Every string in a result has the operator's secrets redacted and is
capped (head and tail kept) so one call cannot flood the model's context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from pydantic import ValidationError

from corral import errors
from corral.output import cap_text
from corral.processes import ProcessRegistry
from corral.sandbox import Sandbox
from corral.tools import handlers
from corral.tools.approvals import (
    ApprovalRequest,
    Approver,
    Gate,
    PermissionMode,
    Rule,
    command_line,
)
from corral.tools.catalog import (
    TOOLS,
    TOOLS_BY_NAME,
    ToolSpec,
    function_name,
    input_schema,
    output_schema,
    warm_schemas_in_background,
)
from corral.tools.results import Approval, ErrorInfo, ToolError, ToolResult
from corral.tools.scopes import Scope
from corral.tools.secrets import SecretStore

logger = logging.getLogger("corral.tools")

SchemaFormat = Literal["openai", "anthropic", "mcp"]
OUTPUT_CHARS = 30_000
EXEC_CAPABILITY = "sandbox.exec"
_ALIASES = {function_name(t.name): t.name for t in TOOLS}
Handler = Callable[[Any], Awaitable[ToolResult]]


def _brief(data: Any, limit: int = 500) -> Any:
    """Arguments as the audit log keeps them: long strings (file contents) cut short."""
    if isinstance(data, str):
        return data if len(data) <= limit else data[:limit] + f"...[{len(data)} chars]"
    if isinstance(data, dict):
        return {str(k)[:limit]: _brief(v, limit) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_brief(v, limit) for v in data[:100]]
    return data


def error(code: str, message: str) -> ToolError:
    return ToolError.of(code, message)


def capability_of(tool: str) -> str:
    """The spec's naming: ``sandbox.exec`` for the exec tool, ``tool.invoke:<name>`` else."""
    return EXEC_CAPABILITY if tool == EXEC_CAPABILITY else f"tool.invoke:{tool}"


def checked_capabilities(capabilities: Iterable[str] | None) -> frozenset[str] | None:
    """``capabilities`` as a set, each one a tool's name, its capability (``sandbox.exec``,
    ``tool.invoke:<name>``) or ``*``; a name that is none of these (a typo would serve
    fewer tools without a word) is an ``invalid_input`` error naming it."""
    if capabilities is None:
        return None
    caps = frozenset(capabilities)
    known = {"*"} | {spec.name for spec in TOOLS} | {capability_of(spec.name) for spec in TOOLS}
    unknown = sorted(caps - known)
    if unknown:
        raise errors.SandboxError(
            f"unknown capabilit{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: "
            f"use tool names ({', '.join(spec.name for spec in TOOLS)}), their capabilities "
            "(sandbox.exec, tool.invoke:<name>) or *",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return caps


def allowed_tools(
    capabilities: Iterable[str] | None = None, permission_mode: PermissionMode = "default"
) -> list[ToolSpec]:
    """The tools a caller with these capabilities, in this mode, may be shown."""
    caps = None if capabilities is None else set(capabilities)
    if permission_mode == "deny":
        return []
    found = []
    for spec in TOOLS:
        if caps is not None and not caps & {"*", spec.name, capability_of(spec.name)}:
            continue
        if permission_mode == "read-only" and not spec.read_only:
            continue
        found.append(spec)
    return found


def tool_schemas(specs: Iterable[ToolSpec], fmt: SchemaFormat = "openai") -> list[dict[str, Any]]:
    """Function-calling definitions for OpenAI, Anthropic or MCP ``tools/list``."""
    out: list[dict[str, Any]] = []
    for spec in specs:
        schema = input_schema(spec.args)
        if fmt == "openai":
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": function_name(spec.name),
                        "description": spec.description,
                        "parameters": schema,
                    },
                }
            )
        elif fmt == "anthropic":
            out.append(
                {
                    "name": function_name(spec.name),
                    "description": spec.description,
                    "input_schema": schema,
                }
            )
        elif fmt == "mcp":
            out.append(
                {
                    "name": spec.name,
                    "description": spec.description,
                    "inputSchema": schema,
                    "outputSchema": output_schema(spec.result),
                    "annotations": {
                        "readOnlyHint": spec.read_only,
                        "destructiveHint": spec.destructive,
                        "openWorldHint": False,
                    },
                }
            )
        else:
            raise ValueError(f"unknown schema format {fmt!r}; use openai, anthropic or mcp")
    return out


def describe_validation(tool: str, exc: ValidationError) -> ToolError:
    """One readable sentence per bad field, and the field paths for programs."""
    fields, parts = [], []
    for err in exc.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "(input)"
        fields.append(where)
        if err["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        elif err["type"] == "missing":
            parts.append(f"{where}: required field is missing")
        else:
            shown = repr(err.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            parts.append(f"{where}: {err['msg']} (got {shown})")
    message = f"invalid input for {tool}: " + "; ".join(parts)
    invalid = ErrorInfo(code=str(errors.ErrorCode.INVALID_INPUT), message=message)
    return ToolError(error=invalid, fields=fields)


class Toolbox:
    """The tools of one sandbox, gated by capabilities, a permission mode and rules."""

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        capabilities: Iterable[str] | None = None,
        permission_mode: PermissionMode = "default",
        approver: Approver | None = None,
        rules: Iterable[Rule] | None = None,
        secrets: SecretStore | None = None,
        output_chars: int = OUTPUT_CHARS,
        share_shells: bool = False,
    ) -> None:
        """``share_shells``: shells the agent opens can be joined by a human with
        ``corral attach`` (the MCP server sets it); by default they stay private."""
        self.sandbox = sandbox
        self.capabilities = checked_capabilities(capabilities)
        self.gate = Gate(permission_mode, None if rules is None else tuple(rules))
        self.approver = approver
        if secrets is None:  # the environment's, and the policy's secrets_file
            secrets = SecretStore.from_env()
            if sandbox.policy.secrets_file is not None:
                secrets = secrets.merged(SecretStore.from_file(sandbox.policy.secrets_file))
        self.secrets = secrets
        self.output_chars = output_chars
        self.scope = Scope(sandbox.registry)
        context = handlers.ToolContext(
            sandbox,
            self.secrets,
            self.scope,
            lambda: [t.name for t in self.tools()],
            share_shells,
            output_chars,
        )
        self._handlers: dict[str, Handler] = handlers.bind(context)
        warm_schemas_in_background()  # schemas() on the loop must not build them there

    def add_child_registry(self, name: str, registry: ProcessRegistry) -> None:
        """Let this agent read a sub-agent's processes (see :mod:`corral.tools.scopes`)."""
        self.scope.add_child_registry(name, registry)

    def tools(self) -> list[ToolSpec]:
        return allowed_tools(self.capabilities, self.gate.mode)

    def schemas(self, format: SchemaFormat = "openai") -> list[dict[str, Any]]:
        return tool_schemas(self.tools(), format)

    def _may_use(self, tool: str) -> bool:
        caps = self.capabilities
        return caps is None or bool(caps & {"*", tool, capability_of(tool)})

    async def call(
        self, name: str, arguments: Any = None, *, approved: bool = False
    ) -> dict[str, Any]:
        """Run one tool call and return its JSON result; never raises (but on cancellation).

        ``approved=True`` says a human already approved this very call (the MCP server sets
        it after an elicitation); ``deny`` verdicts hold regardless.
        """
        started = time.monotonic()
        result = await self._call(name, arguments, approved)
        audit = self.sandbox.audit
        if audit.enabled:
            err = result.get("error")
            audit.record(
                "tool",
                tool=str(name)[:80],
                arguments=_brief(self.secrets.redact_all(arguments)),
                error=err.get("code") if isinstance(err, dict) else None,
                duration=round(time.monotonic() - started, 6),
            )
        return result

    async def _call(self, name: str, arguments: Any, approved: bool) -> dict[str, Any]:
        return self.finish((await self._result(name, arguments, approved)).to_json())

    async def _result(self, name: str, arguments: Any, approved: bool) -> ToolResult:
        tool = _ALIASES.get(name, name) if isinstance(name, str) else ""
        spec = TOOLS_BY_NAME.get(tool)
        if spec is None:
            known = ", ".join(t.name for t in TOOLS)
            return error("unknown_tool", f"unknown tool {str(name)[:80]!r}; tools: {known}")
        if not self._may_use(tool):
            return error("access_denied", f"access denied: {tool}")
        try:
            args = spec.args.model_validate({} if arguments is None else arguments)
        except ValidationError as exc:
            return describe_validation(tool, exc)
        refusal = await self._check_gate(tool, args.model_dump(mode="json"), approved)
        if refusal is not None:
            return refusal
        try:
            return await self._handlers[tool](args)
        except errors.SandboxError as exc:
            return ToolError.model_validate(exc.to_dict())
        except Exception as exc:  # the model must get an answer, never a traceback
            logger.exception("tool %s failed", tool)
            return error("internal_error", f"internal error in {tool}: {type(exc).__name__}")

    async def _check_gate(
        self, tool: str, arguments: dict[str, Any], approved: bool
    ) -> ToolError | None:
        verdict = self.gate.verdict(tool, arguments)
        if verdict.outcome == "allow":
            return None
        line = command_line(tool, arguments)

        def decided(decision: str) -> None:
            self.sandbox.audit.record(
                "approval",
                tool=tool,
                command=self.secrets.redact_all(line),
                decision=decision,
                reason=verdict.reason,
            )

        if verdict.outcome == "ask" and approved:
            decided("approved")  # by a human before the call (the MCP server's elicitation)
            return None
        if verdict.outcome == "deny":
            decided("denied_by_policy")
            return error("approval_denied", f"denied by policy: {verdict.reason}")
        request = ApprovalRequest(tool, line, verdict.reason, arguments)
        if self.approver is None:
            decided("approval_required")
            message = (
                f"{request.describe()} This call needs a human's approval: ask the user, "
                "then retry once they have approved it."
            )
            return ToolError(
                error=ErrorInfo(code="approval_required", message=message),
                approval=Approval(tool=tool, command=request.command_line, reason=verdict.reason),
            )
        try:
            ok = await self.approver(request)
        except Exception as exc:
            # Not a "no": nobody was asked (the approval server is down, refused the
            # request). The model must not tell the user they declined.
            cause = str(exc) or type(exc).__name__
            logger.warning("approver failed for %s: %s", tool, cause)
            decided("approval_failed")
            return error(
                "approval_unavailable",
                f"could not ask a human ({cause[:300]}), so the call did not run: "
                f"{request.describe()}",
            )
        decided("approved" if ok else "declined")
        return None if ok else error("approval_denied", f"the user declined: {request.describe()}")

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Redact secrets first (a cut could split a value), then cap long strings."""
        redacted = self.secrets.redact_all(result)
        capped, truncated = self._cap(redacted)
        assert isinstance(capped, dict)
        if truncated:
            capped["truncated"] = True
        if _has_replacement(capped):  # said, not silent: the model may rely on the bytes
            capped["not_utf8"] = True
        return capped

    def _cap(self, data: Any) -> tuple[Any, bool]:
        if isinstance(data, str):
            return cap_text(data, self.output_chars)
        if isinstance(data, dict):
            out, any_cut = {}, False
            for k, v in data.items():
                out[k], cut = self._cap(v)
                any_cut |= cut
            return out, any_cut
        if isinstance(data, list):
            items = [self._cap(v) for v in data]
            return [v for v, _ in items], any(c for _, c in items)
        return data, False


def _has_replacement(data: Any) -> bool:
    """Whether a string of ``data`` holds U+FFFD, what output's bytes that are not UTF-8
    decode to (a program printing U+FFFD itself is flagged too: rare, and said as such)."""
    if isinstance(data, str):
        return "\ufffd" in data
    if isinstance(data, dict):
        return any(_has_replacement(v) for v in data.values())
    if isinstance(data, list):
        return any(_has_replacement(v) for v in data)
    return False
