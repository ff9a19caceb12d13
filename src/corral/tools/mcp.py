"""The agent tools over MCP (official ``mcp`` SDK), on stdio or streamable HTTP.

Each MCP session gets its own sandbox, started on its first tool call (listing tools costs
nothing) and closed when the session ends: on stdio when the client hangs up, on HTTP when
the client deletes the session or leaves it idle. A call the approval rules mark ``ask`` is
put to the human through MCP elicitation when the client supports it (a server request on
2025 sessions, an ``InputRequiredResult`` round on 2026-07-28 ones); otherwise the model
gets a structured ``approval_required`` result to relay.

Tool failures are results with ``isError`` (the model reads them and corrects itself);
only an unknown tool name is a protocol error.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import mcp_types as types
import pydantic_core
import uvicorn
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import errors
from corral.policy import Policy
from corral.sandbox import Sandbox
from corral.server.transport import (
    LOOPBACK,
    http_server_config,
)
from corral.tools.approvals import PermissionMode, Rule
from corral.tools.secrets import SecretStore
from corral.tools.toolbox import Toolbox, allowed_tools, checked_capabilities, tool_schemas
from corral.workspaces import refuse_dangerous_workspace

logger = logging.getLogger("corral.mcp")

STDIO_SESSION = "stdio"
IDLE_TIMEOUT = 30 * 60.0
APPROVAL_TIMEOUT = 300.0
"""How long a call waits for the human's answer to an elicitation (as the dashboard's)."""
APPROVAL_KEY = "corral_approval"
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"approve": {"type": "boolean", "title": "Approve this action?"}},
    "required": ["approve"],
}


@dataclass(frozen=True)
class ServerConfig:
    """What every session's sandbox and toolbox are made from."""

    policy: Policy = field(default_factory=Policy)
    workspace: Path | None = None
    """Shared by all sessions when set; else each session gets a fresh temporary one."""
    capabilities: frozenset[str] | None = None
    permission_mode: PermissionMode = "default"
    rules: tuple[Rule, ...] | None = None
    secrets: SecretStore = field(default_factory=SecretStore.from_env)
    idle_timeout: float = IDLE_TIMEOUT
    approval_timeout: float = APPROVAL_TIMEOUT
    """How long a call that needs a human waits for the client's elicitation answer."""
    share_shells: bool = True
    """The agent's shells can be joined with ``corral attach`` (the human hand-off)."""
    allow_dangerous_workspace: bool = False
    """Accept ``/``, a system directory or a home directory as ``workspace`` (refused with
    :class:`~corral.errors.DangerousWorkspace` when the config is made, else)."""

    def __post_init__(self) -> None:
        if self.workspace is not None and not self.allow_dangerous_workspace:
            refuse_dangerous_workspace(self.workspace)


@dataclass
class _Session:
    toolbox: Toolbox
    last_used: float
    busy: int = 0
    """Tool calls of the session in progress: a session is idle only when it has none."""


class Sessions:
    """Sandboxes by MCP session key, made on first use and closed at session end.

    With ``idle_timer`` (HTTP, where a session ends when its client says so), a session
    left idle for ``config.idle_timeout`` is closed by a timer (a task that runs while
    sandboxes are open): a client that dies without deleting its session (the usual way an
    agent ends) must not leave its sandbox running for the server's lifetime. (On stdio the
    one session ends with stdin.)
    """

    def __init__(self, config: ServerConfig, *, idle_timer: bool = False) -> None:
        self.config = config
        self.idle_timer = idle_timer
        self._open: dict[str, _Session] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._reaper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    async def toolbox(self, key: str) -> Toolbox:
        await self.reap_idle(exclude=key)
        lock = self._starting.setdefault(key, asyncio.Lock())
        async with lock:  # two first calls racing must not start two sandboxes
            entry = self._open.get(key)
            if entry is None:
                sandbox = Sandbox(
                    self.config.policy,
                    workspace=self.config.workspace,
                    allow_dangerous_workspace=self.config.allow_dangerous_workspace,
                )
                await sandbox.start()
                toolbox = Toolbox(
                    sandbox,
                    capabilities=self.config.capabilities,
                    permission_mode=self.config.permission_mode,
                    rules=self.config.rules,
                    secrets=self.config.secrets,
                    share_shells=self.config.share_shells,
                )
                entry = self._open[key] = _Session(toolbox, time.monotonic())
                logger.info("session %s: started sandbox %s", key, sandbox.sandbox_id)
                if self.idle_timer and (self._reaper is None or self._reaper.done()):
                    self._reaper = asyncio.create_task(self._reap_on_time())
        entry.last_used = time.monotonic()
        entry.busy += 1
        return entry.toolbox

    def release(self, key: str) -> None:
        """The end of a tool call that :meth:`toolbox` began: the session's idle time
        counts from here."""
        entry = self._open.get(key)
        if entry is not None:
            entry.busy = max(0, entry.busy - 1)
            entry.last_used = time.monotonic()

    async def _reap_on_time(self) -> None:
        """Close each session once it has been idle for the timeout, while any is open."""
        while self._open:
            idle = [e.last_used for e in self._open.values() if not e.busy]
            # A busy session is looked at again a timeout later at the latest.
            due = min(idle, default=time.monotonic()) + self.config.idle_timeout
            await asyncio.sleep(max(0.0, due - time.monotonic()) + 0.05)
            try:
                await self.reap_idle()
            except Exception:  # one sandbox failing to close must not stop the timer
                logger.exception("closing an idle session failed")

    async def close(self, key: str) -> None:
        entry = self._open.pop(key, None)
        self._starting.pop(key, None)
        if entry is not None:
            logger.info("session %s: closing sandbox %s", key, entry.toolbox.sandbox.sandbox_id)
            await entry.toolbox.sandbox.aclose()

    async def reap_idle(self, exclude: str | None = None) -> None:
        deadline = time.monotonic() - self.config.idle_timeout
        for key in [
            k
            for k, e in self._open.items()
            if e.last_used < deadline and not e.busy and k != exclude
        ]:
            await self.close(key)

    async def aclose(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper is not asyncio.current_task():
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        for key in list(self._open):
            await self.close(key)


def session_key(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """stdio is one session; on HTTP the transport's session id names it."""
    request = ctx.request
    if request is None:
        return STDIO_SESSION
    headers = getattr(request, "headers", None)
    value = headers.get("mcp-session-id") if headers is not None else None
    return value if isinstance(value, str) and value else None


def _wants_elicitation(ctx: ServerRequestContext[Any, Any]) -> bool:
    caps = ctx.session.client_capabilities
    return caps is not None and caps.elicitation is not None


def _to_result(result: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(result, ensure_ascii=False))],
        structured_content=result,
        is_error="error" in result,
    )


def _approval_unavailable(result: dict[str, Any]) -> dict[str, Any]:
    """``approval_required`` when no human can be asked: a retry would fail the same way."""
    message = (
        f"{_approval_prompt(result)}. This call needs a human's approval, and this MCP client "
        "cannot ask one (it does not support elicitation), so retrying it will fail the same "
        "way: do not retry; tell the user what you wanted to run and why. The operator can "
        "use an MCP client with elicitation, start the server with --permission-mode auto, "
        "or change the approval rules."
    )
    out: dict[str, Any] = {
        "error": {"code": "approval_unavailable", "message": message, "retryable": False}
    }
    if "approval" in result:
        out["approval"] = result["approval"]
    return out


def _approval_prompt(result: dict[str, Any]) -> str:
    approval = result.get("approval") or {}
    what = approval.get("command") or approval.get("tool") or "this call"
    reason = approval.get("reason")
    return f"The agent wants to run: {what}" + (f" ({reason})" if reason else "")


def _approved(answer: types.ElicitResult) -> bool:
    """Only ``accept`` with ``approve`` the JSON boolean ``true`` approves. A form-based
    client may send its fields as strings, and ``bool("false")`` is true: an answer of any
    other shape (``"false"``, ``"no"``, ``1``, a missing field) is a refusal."""
    return answer.action == "accept" and (answer.content or {}).get("approve") is True


def _no_answer(pending: dict[str, Any], why: str) -> dict[str, Any]:
    """The tool error for an elicitation that brought no answer: the call did not run."""
    message = f"could not ask a human ({why}), so the call did not run: {_approval_prompt(pending)}"
    return {"error": {"code": "approval_unavailable", "message": message}}


async def _ask_human(
    ctx: ServerRequestContext[Any, Any],
    params: types.CallToolRequestParams,
    pending: dict[str, Any],
    timeout: float,
) -> bool | types.InputRequiredResult | dict[str, Any]:
    """True/False from the human, the InputRequiredResult that asks them (2026 era), or a
    tool error when the client answered with an error, an answer of no known shape, or
    nothing within ``timeout`` seconds: a tool failure is a result, not a protocol error
    (and never a call that hangs for ever)."""
    message = _approval_prompt(pending)
    if ctx.session.can_send_request:
        try:
            async with asyncio.timeout(timeout):
                answer = await ctx.session.elicit_form(message, APPROVAL_SCHEMA, ctx.request_id)
        except TimeoutError:
            return _no_answer(pending, f"the client gave no answer within {timeout:g} s")
        except MCPError as exc:
            return _no_answer(
                pending, f"the client answered with an error: {exc.error.message[:200]}"
            )
        except Exception as exc:  # a malformed answer (an unknown action, a wrong type)
            logger.info("elicitation answer not understood: %s", exc)
            return _no_answer(pending, "the client's answer was not understood")
    else:
        responses = params.input_responses or {}
        reply = responses.get(APPROVAL_KEY)
        if not isinstance(reply, types.ElicitResult):
            request = types.ElicitRequest(
                params=types.ElicitRequestFormParams(
                    message=message, requested_schema=APPROVAL_SCHEMA
                )
            )
            return types.InputRequiredResult(input_requests={APPROVAL_KEY: request})
        answer = reply
    return _approved(answer)


async def _call_with_approval(
    ctx: ServerRequestContext[Sessions, Any],
    params: types.CallToolRequestParams,
    toolbox: Toolbox,
    timeout: float,
) -> types.CallToolResult | types.InputRequiredResult:
    """One tool call, with a human asked through elicitation when a rule says ``ask``
    (``timeout``: how long the human's answer is waited for)."""
    arguments = params.arguments or {}
    result = await toolbox.call(params.name, arguments)
    code = result.get("error", {}).get("code")
    if code == "approval_required" and not _wants_elicitation(ctx):
        return _to_result(_approval_unavailable(result))
    if code == "approval_required":
        answer = await _ask_human(ctx, params, result, timeout)
        if isinstance(answer, types.InputRequiredResult):
            return answer
        if isinstance(answer, dict):
            result = answer
        elif answer:
            result = await toolbox.call(params.name, arguments, approved=True)
        else:
            message = f"the user declined: {_approval_prompt(result)}"
            result = {"error": {"code": "approval_denied", "message": message}}
    return _to_result(result)


def build_server(
    config: ServerConfig, *, http: bool = False, sessions: Sessions | None = None
) -> Server[Sessions]:
    """The MCP server: ``tools/list`` and ``tools/call`` over per-session toolboxes."""
    specs = allowed_tools(config.capabilities, config.permission_mode)
    listed = [types.Tool.model_validate(t) for t in tool_schemas(specs, "mcp")]
    names = {t.name for t in specs}

    @contextlib.asynccontextmanager
    async def lifespan(_: Server[Sessions]) -> AsyncIterator[Sessions]:
        state = sessions if sessions is not None else Sessions(config)
        try:
            yield state
        finally:
            await state.aclose()

    async def list_tools(
        ctx: ServerRequestContext[Sessions, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(
        ctx: ServerRequestContext[Sessions, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        if params.name not in names:
            raise MCPError(
                code=types.INVALID_PARAMS,
                message=f"unknown tool {params.name!r}; tools/list shows the tools",
            )
        key = session_key(ctx)
        if key is None:
            return _to_result(
                {
                    "error": {
                        "code": "no_session",
                        "message": "this server keeps a sandbox per MCP session; connect "
                        "with a session (the 2025-11-25 protocol) to use its tools",
                    }
                }
            )
        try:
            toolbox = await ctx.lifespan_context.toolbox(key)
        except errors.SandboxError as exc:
            # The documented error object, not the SDK's bare "Internal server error".
            logger.warning("session %s: sandbox failed to start: %s", key, exc)
            return _to_result(exc.to_dict())
        except Exception as exc:
            logger.exception("session %s: sandbox failed to start", key)
            message = f"the sandbox failed to start: {type(exc).__name__}: {exc}"
            return _to_result({"error": {"code": "sandbox_start_failed", "message": message}})
        try:
            return await _call_with_approval(ctx, params, toolbox, config.approval_timeout)
        finally:
            ctx.lifespan_context.release(key)

    server: Server[Sessions] = Server(
        "corral",
        version="0.1.0",
        instructions="Sandboxed command execution. Each session has its own Linux sandbox.",
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
    if http:
        # The 2026-07-28 HTTP era has no sessions, and a sandbox must outlive one request:
        # refusing discovery makes clients fall back to the session-based handshake.
        async def no_discover(
            ctx: ServerRequestContext[Sessions, Any], params: types.RequestParams | None
        ) -> types.DiscoverResult:
            raise MCPError(code=types.METHOD_NOT_FOUND, message="use the initialize handshake")

        server.add_request_handler("server/discover", types.RequestParams, no_discover)
    return server


async def serve_stdio(config: ServerConfig, after: Callable[[], None] | None = None) -> None:
    """Serve MCP on stdin/stdout until the client closes stdin. ``after`` runs once the
    server has stopped and its sessions' sandboxes are closed, before the stdin reader is
    waited for (a thread that only the client closing stdin ends)."""
    server = build_server(config)
    async with _stdio_streams() as (read_stream, write_stream):
        try:
            await server.run(read_stream, write_stream, server.create_initialization_options())
        finally:
            if after is not None:
                after()


def _take_std_fd(fd: int, stand_in: int) -> int:
    """A private duplicate of standard descriptor ``fd`` for the protocol, with ``fd`` itself
    pointed at ``stand_in``: a stray read or print of this process (or a child's) misses the
    wire. The duplicate is never closed: the stdin reader's thread may still block on it."""
    wire = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.dup2(stand_in, fd)
    os.close(stand_in)
    return wire


def _unreadable(line: str, exc: ValidationError) -> types.JSONRPCError:
    """The answer to a line that is no JSON-RPC message, as the HTTP transport gives it: a
    parse error (-32700, id null) for text that is not JSON (a lone surrogate escape, a cut
    line), invalid params (-32602) with the request's id for a request of the wrong shape,
    else an invalid request (-32600, id null). A client must not wait for ever."""
    try:
        data = pydantic_core.from_json(line)
    except ValueError as bad:
        error = types.ErrorData(code=types.PARSE_ERROR, message=f"Parse error: {bad}")
        return types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
    request_id = data.get("id") if isinstance(data, dict) and "method" in data else None
    if isinstance(request_id, str | int) and not isinstance(request_id, bool):
        message = f"Validation error: {exc.error_count()} invalid field(s) in the request"
        error = types.ErrorData(code=types.INVALID_PARAMS, message=message)
        return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
    message = "Invalid request: not a JSON-RPC 2.0 message"
    error = types.ErrorData(code=types.INVALID_REQUEST, message=message)
    return types.JSONRPCError(jsonrpc="2.0", id=None, error=error)


@contextlib.asynccontextmanager
async def _stdio_streams() -> AsyncIterator[
    tuple[
        MemoryObjectReceiveStream[SessionMessage | Exception],
        MemoryObjectSendStream[SessionMessage],
    ]
]:
    """The stdio transport (newline-delimited JSON-RPC), in place of the SDK's: a client
    that dies with a call in flight closes both pipes, and the SDK's writer then raised
    ``BrokenPipeError`` through the server, which crashed with a traceback and cut its
    sessions' teardown short (the sandbox's workspace, mount and cgroups left behind).
    Here a write to a client that is gone drops the message; the server ends, closing its
    sandboxes, when stdin ends."""
    wire_in = _take_std_fd(0, os.open(os.devnull, os.O_RDONLY))
    wire_out = _take_std_fd(1, os.dup(2))
    stdin = anyio.wrap_file(os.fdopen(wire_in, "rb", closefd=False))
    stdout = os.fdopen(wire_out, "wb", buffering=0, closefd=False)
    to_server, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, from_server = anyio.create_memory_object_stream[SessionMessage](0)
    client_gone = False
    writing = anyio.Lock()  # the reader answers unreadable lines: one line at a time

    def write(line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[stdout.write(view) or 0 :]

    async def emit(message: types.JSONRPCMessage) -> None:
        nonlocal client_gone
        if client_gone:
            return
        line = message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
        try:
            async with writing:
                await anyio.to_thread.run_sync(write, line)
        except OSError as exc:  # EPIPE, ECONNRESET: nobody reads the answers any more
            logger.info("stdout closed (%s): answers are dropped until stdin ends", exc)
            client_gone = True

    async def reader() -> None:
        async with to_server:
            async for raw in stdin:
                line = raw.decode("utf-8", "replace")
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValidationError as exc:  # the SDK's server drops these unanswered
                    await emit(_unreadable(line, exc))
                    continue
                await to_server.send(SessionMessage(message))

    async def writer() -> None:
        async with from_server:
            async for session_message in from_server:
                await emit(session_message.message)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
            yield read_stream, write_stream
    finally:
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)


def parse_capabilities(values: Iterable[str] | None) -> frozenset[str] | None:
    if not values:
        return None
    return checked_capabilities(c.strip() for v in values for c in v.split(",") if c.strip())


# ---- streamable HTTP -------------------------------------------------------------------------


class HttpApp:
    """In front of the SDK's app: the bearer token, and sandbox teardown on session DELETE."""

    def __init__(self, app: ASGIApp, sessions: Sessions, token: str | None) -> None:
        self.app = app
        self.sessions = sessions
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        if self.expected is not None and not hmac.compare_digest(given, self.expected):
            await _unauthorized(send)
            return
        session_id = headers.get(b"mcp-session-id")
        if scope.get("method") != "DELETE" or not session_id:
            await self.app(scope, receive, send)
            return
        key = session_id.decode("latin-1")
        status = 0

        async def send_after_close(message: Message) -> None:
            # Hold the end of the response until the sandbox is gone, so a client that
            # has seen its DELETE answered knows nothing of its session is left running.
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif not message.get("more_body") and status < 400:
                await self.sessions.close(key)
            await send(message)

        await self.app(scope, receive, send_after_close)


async def _unauthorized(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"error": "bearer token required"}'})


def build_http_app(
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    token: str | None = None,
    insecure_no_token: bool = False,
) -> HttpApp:
    """The streamable HTTP app (path ``/mcp``), behind a bearer token.

    Any local user can connect to a loopback port, so a token is required there too unless
    ``insecure_no_token`` says otherwise; off loopback it is required always.

    Raises:
        PolicyError: no ``token`` and not ``insecure_no_token``, or not loopback and no token.
    """
    if not token and (host not in LOOPBACK or not insecure_no_token):
        where = "" if host in LOOPBACK else f" on {host} (not loopback)"
        raise errors.PolicyError(
            f"serving MCP over HTTP{where} needs a bearer token: pass --token or set "
            "CORRAL_MCP_TOKEN (corral mcp generates one when neither is given)"
        )
    sessions = Sessions(config, idle_timer=True)
    server = build_server(config, http=True, sessions=sessions)
    app = server.streamable_http_app(host=host, session_idle_timeout=config.idle_timeout)
    return HttpApp(app, sessions, token)


def describe_config(config: ServerConfig) -> str:
    """One line about what the agent may do (for the start-up message)."""
    policy = config.policy
    tools = len(allowed_tools(config.capabilities, config.permission_mode))
    workspace = str(config.workspace) if config.workspace else "fresh temp dir per session"
    return (
        f"backend {policy.backend}, network {policy.network.mode}, "
        f"permission mode {config.permission_mode}, {tools} tools, workspace {workspace}"
    )


async def serve_http(
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    token: str | None = None,
    insecure_no_token: bool = False,
    sock: socket.socket | None = None,
) -> None:
    """Serve until cancelled. Pass a bound, listening ``sock`` to pick the port yourself."""
    app = build_http_app(config, host=host, token=token, insecure_no_token=insecure_no_token)
    server = uvicorn.Server(http_server_config(app, host, port))
    await server.serve(sockets=[sock] if sock is not None else None)
