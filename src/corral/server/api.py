"""The HTTP API of ``corral serve`` (FastAPI on uvicorn; its OpenAPI document is served at
``/openapi.json`` and checked in as ``docs/openapi.json``).

Boxes are made with ``POST /v1/boxes`` and live until ``DELETE``, their TTL, their idle
timeout or the server's end. Commands run to completion (``/run``), in the background
(``/run`` with ``background``: then ``/processes/...``), or streamed (``/exec``: a body of
frames, see :mod:`corral.client.frames`). File contents and stdin travel as raw byte streams,
never inside JSON. Terminals attach over a WebSocket. Every error is
``{"error": {"code", "message", "retryable"}}`` with the library's stable code.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

import anyio
from fastapi import FastAPI, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import errors
from corral.client import frames
from corral.output import text_bytes
from corral.policy import Policy
from corral.processes import Process, Skipped
from corral.sandbox import Sandbox
from corral.server.approvals import Approvals
from corral.server.auth import AsciiJSONResponse, deny_websocket, error_body, status_for
from corral.server.boxes import Boxes, HeldBox
from corral.server.dashboard import add_dashboard
from corral.server.metrics import Metrics
from corral.streaming import Exited, Stdout

__all__ = ["build_api"]

logger = logging.getLogger("corral.server")
CHUNK = 4 << 20
MAX_STDIN = 256 << 20
API_VERSION = "1"


# ---- request and response models -------------------------------------------------------------
class _In(BaseModel):
    # No inf or NaN: a timeout or TTL of inf would be echoed back in a response JSON
    # cannot carry (a 500), and NaN compares false with every bound.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class BoxCreate(_In):
    policy: dict[str, Any] | None = Field(
        None,
        description="A corral policy as JSON (the TOML file's tables); default policy if absent",
    )
    workspace: str | None = Field(
        None, description="Host directory to share at the policy's workdir; a fresh one if absent"
    )
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_secs: float | None = Field(
        None, gt=0, description="Close the box this long after it is made"
    )
    idle_timeout_secs: float | None = Field(
        None, gt=0, description="Close the box after this long with no request and nothing running"
    )
    allow_dangerous_workspace: bool = False
    cli_argv: list[str] | None = Field(
        None,
        description="Instead of policy/workspace: `corral run`'s sandbox flags (corral create)",
    )


class BoxOut(BaseModel):
    id: str
    sandbox_id: str = Field(description="the library's id of the box (state, audit log)")
    state: Literal["running", "paused", "broken", "closed"]
    labels: dict[str, str]
    created_at: float
    ttl_secs: float | None
    idle_timeout_secs: float | None
    expires_in_secs: float | None
    idle_secs: float
    backend: str
    network: str
    warnings: list[str]
    processes: int
    sessions: list[str]
    limits: dict[str, Any]
    published: list[str]
    stats: dict[str, Any] | None = None
    broken: str | None = Field(
        None,
        description="state broken: why the box died (its agent exited, its channel broke); "
        "every request to it fails with sandbox_broken, a retry in a new box may help",
    )


class SnapshotIn(_In):
    name: str = Field(description="the new image's ref in the store")
    processes: Literal["warn", "error"] = Field(
        "warn",
        description="processes besides the guest agent running, whose state cannot be kept: "
        "a filesystem-only snapshot with a warning, or the error process_state_unavailable",
    )
    workspace: bool = Field(False, description="keep a copy of the box's workspace too")


class SnapshotOut(BaseModel):
    ref: str = Field(description="the new image's ref: Policy(image=...) takes it")
    warnings: list[str] = Field(description="what the snapshot could not keep")
    workspace: bool = Field(description="whether it carries the box's workspace")
    processes: int = Field(
        description="processes besides the guest agent that ran (-1: not countable); their "
        "state is not kept"
    )


class ForkIn(_In):
    n: int = Field(1, ge=1, le=64)
    labels: dict[str, str] = Field(default_factory=dict)
    processes: Literal["warn", "error"] = Field("warn", description="as for a snapshot")
    workspace: bool = Field(False, description="each fork starts with a copy of the workspace")


class RunIn(_In):
    cmd: list[str] | str = Field(description="argv, or a string run by /bin/sh -c")
    timeout: float | None = Field(None, gt=0)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = Field(None, description="text fed to the command's stdin, then EOF")
    stdin_base64: str | None = Field(None, description="bytes for stdin, base64 (not with stdin)")
    background: bool = Field(False, description="return at once with the process; see /processes")
    stdin_pipe: bool = Field(
        False, description="background: keep stdin open for POST .../processes/{pid}/stdin"
    )


class PoolRunIn(RunIn):
    policy: dict[str, Any] | None = Field(None, description="the pool's policy (as for a box)")
    workspace: str | None = None


class ResultOut(BaseModel):
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_ms: float
    truncated: bool
    pid: int
    oom_killed: bool = False
    pids_limited: bool = False
    network_refusals: list[dict[str, Any]] = []
    timeout: float | None = None
    ended: str = "exited"


class ProcessOut(BaseModel):
    pid: int
    command: str
    status: str
    exit_code: int | None
    started_at: float
    duration: float
    timed_out: bool = False


class SignalIn(_In):
    signal: str | int = "SIGTERM"
    group: bool = True


class SessionIn(_In):
    shell: str | None = Field(None, description="default: bash if the box has it, else sh")
    cols: int = Field(80, ge=10, le=1000)
    rows: int = Field(24, ge=2, le=1000)
    env: dict[str, str] | None = None
    cwd: str | None = None


class SessionOut(BaseModel):
    id: str
    shell: str
    pid: int
    attached: int
    closed: bool
    exit_code: int | None


class ExpectIn(_In):
    pattern: str
    timeout: float | None = Field(30.0, gt=0)


class WriteIn(_In):
    data: str


class CliRunIn(_In):
    argv: list[str] = Field(description="the arguments of `corral run` after `run`")
    stdin: bool = Field(False, description="the request body is the command's stdin")


# ---- helpers -----------------------------------------------------------------------------------
def _query_pairs(request: HTTPConnection) -> list[tuple[str, str]]:
    """The query as the client's bytes meant it: a value that is not UTF-8 (a name the
    remote SDK sent as ``os.fsencode`` made it) comes back as ``os.fsdecode`` gives it, with
    lone surrogates, where Starlette's own parse puts U+FFFD."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    return parse_qsl(raw, keep_blank_values=True, errors="surrogateescape")


def _exact(request: HTTPConnection, name: str, value: str) -> str:
    """Query parameter ``name`` (``value`` as Starlette parsed it), byte for byte."""
    if "\ufffd" not in value:
        return value
    found = [v for k, v in _query_pairs(request) if k == name]
    return found[-1] if found else value  # the last, as Starlette takes it


def _exact_all(request: HTTPConnection, name: str, values: list[str]) -> list[str]:
    """Every value of query parameter ``name``, byte for byte (see :func:`_exact`)."""
    if not any("\ufffd" in v for v in values):
        return values
    return [v for k, v in _query_pairs(request) if k == name]


def _problems(found: Sequence[Any]) -> str:
    """pydantic's errors on one line: ``where: what`` for the first five."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in found[:5]
    )


def _session_out(sb: Sandbox, session_id: str) -> SessionOut:
    s = sb.session(session_id)
    return SessionOut(
        id=s.session_id,
        shell=s.shell,
        pid=s.process.pid,
        attached=s.attached,
        closed=s.closed,
        exit_code=s.exit_code,
    )


def _policy(data: dict[str, Any] | None) -> Policy:
    return Policy() if data is None else Policy.from_dict(data)


def _status_for_cli(code: int, timed_out: bool) -> int:
    if timed_out:
        return 124
    return code if code >= 0 else 128 - code


def _stdin_of(body: RunIn) -> str | bytes | None:
    if body.stdin_base64 is None:
        return body.stdin
    try:
        return base64.b64decode(body.stdin_base64, validate=True)
    except ValueError:
        raise errors.SandboxError(
            "stdin_base64 is not base64", code=errors.ErrorCode.INVALID_INPUT
        ) from None


async def _body(request: Request, limit: int = MAX_STDIN) -> bytes:
    """The whole request body (a command's stdin), read before the response starts: once a
    streamed response begins, the server reads the connection only to notice a disconnect."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.RequestTooLarge(
                f"stdin over {limit >> 20} MiB; write a file into the box instead "
                "(PUT .../files/content, corral cp) and redirect from it"
            )
        parts.append(chunk)
    return b"".join(parts)


async def _feed(data: bytes, stream: Any) -> errors.SandboxError | None:
    """Give a command its stdin, in messages under the channel's cap (one message carries
    at most 16 MiB: a larger stdin sent whole was refused), then end it. A command that
    stops reading (exits, closes its stdin) ends the upload, as a broken pipe would; any
    other failure ends the command, which must not run on part of its input, and is
    returned for the response to say."""
    try:
        await stream.write(data)  # in pieces a message to the box can hold
        await stream.close_stdin()
    except (errors.ProcessNotFound, errors.SpawnFailed):
        return None
    except errors.SandboxError as exc:
        if exc.code is errors.ErrorCode.INVALID_INPUT:  # its stdin is closed
            return None
        with contextlib.suppress(errors.SandboxError):
            await stream.kill()
        return exc
    return None


def _closed_by_server(
    boxes: Boxes, sb: Sandbox, held: HeldBox | None, how: str
) -> errors.SandboxError | None:
    """The error for a command whose box the server closed under it (a lease ended, a
    caller deleted it, the server is stopping), or None when the end was the command's own:
    the kill that ended it is the box's, and a harness must be able to retry rather than
    score it. ``how`` is the end the command itself would report."""
    why = held.ended if held is not None else ("shutdown" if boxes.closing and sb.closed else None)
    if why is None:
        return None
    if why == "shutdown":
        return errors.ServerUnavailable(
            f"the server is shutting down and closed the box while the command ran (its end, "
            f"{how}, was the box's, not its own); retry on its successor"
        )
    name = held.id if held is not None else sb.sandbox_id
    if why == "deleted":
        return errors.SandboxClosed(
            f"box {name} was deleted while the command ran: the command's end ({how}) was "
            "the box's, not its own"
        )
    return errors.SandboxClosed(
        f"the server closed box {name} while the command ran (its {why} lease ended): the "
        f"command's end ({how}) was the box's, not its own"
    )


async def _stream_command(
    sb: Sandbox,
    command: list[str] | str,
    *,
    cwd: str | None,
    env: dict[str, str] | None,
    timeout: float | None,
    stdin: bytes | None,
    metrics: Metrics,
    closed_by_server: Callable[[str], errors.SandboxError | None] = lambda how: None,
) -> AsyncIterator[bytes]:
    """Frames of one command's output, then its end (or the error that stopped it: the
    server closing its box under it is one, see :func:`_closed_by_server`)."""
    from corral.net.cli import refusal_lines

    oom_before = sb.oom_kills()
    refused_before = len(sb.network_refusals())
    if timeout is None:
        timeout = sb.policy.limits.exec_timeout_secs
    try:
        stream = await sb.exec_stream(
            command,
            stdin="pipe" if stdin is not None else None,
            cwd=cwd,
            env=env,
            timeout=timeout,
        )
    except errors.SpawnFailed as exc:
        status = 127 if isinstance(exc, errors.CommandNotFound) else 126
        # A name that is not UTF-8 is in the message as surrogates (os.fsdecode): shown
        # escaped, as the in-process CLI's stderr shows it; a plain encode() raised, and
        # a command that was not found became internal_error.
        note = f"corral: {exc.message}".encode("utf-8", "backslashreplace")
        yield frames.frame(frames.NOTE, note)
        yield frames.json_frame(
            frames.END,
            {
                "exit_code": status,
                "status": status,
                "timed_out": False,
                "ended": "not_started",
                "error": exc.to_dict()["error"],
            },
        )
        return
    feeder = asyncio.ensure_future(_feed(stdin, stream)) if stdin is not None else None
    exits: list[int] = []
    try:
        async for chunk in _output_frames(stream, exits):
            yield chunk
    finally:
        if feeder is not None and not feeder.done():
            feeder.cancel()
    fed = feeder is not None and feeder.done() and not feeder.cancelled()
    failed = feeder.result() if feeder is not None and fed else None
    if failed is not None:
        raise failed  # the command's stdin did not all arrive: said, not hidden
    code = exits[0] if exits else -9
    timed_out = bool(stream.timed_out)
    oom = sb.oom_kills() > oom_before
    if timed_out:
        yield frames.frame(frames.NOTE, f"corral: timed out after {timeout or 0:g} s".encode())
    if oom:
        yield frames.frame(frames.NOTE, b"corral: the memory limit killed a process (--memory)")
    for line in refusal_lines(sb.network_refusals()[refused_before:]):
        yield frames.frame(frames.NOTE, line.encode())
    ended = _how_ended(code, timed_out, oom)
    if (closed := closed_by_server(ended)) is not None:
        raise closed
    metrics.ended(ended, timed_out)
    yield frames.json_frame(
        frames.END,
        {
            "exit_code": code,
            "status": _status_for_cli(code, timed_out),
            "timed_out": timed_out,
            "timeout": timeout,
            "ended": ended,
        },
    )


def _how_ended(code: int, timed_out: bool, oom: bool) -> str:
    """A streamed command's ``ended``, as :class:`~corral.models.ExecResult` says it."""
    if timed_out:
        return "timed_out"
    return "oom_killed" if oom else ("signalled" if code < 0 else "exited")


def truncated_note(box_id: str) -> str:
    """The line ``corral logs`` prints when the box kept only part of a process's output."""
    return (
        f"corral: output truncated: over {box_id}'s output cap (--output-bytes) the middle of "
        "a stream was cut; to keep it all, redirect the command's output to a file in the box "
        "and copy it out (corral cp)"
    )


async def _captured(
    sb: Sandbox,
    args: argparse.Namespace,
    command: list[str],
    env: dict[str, str],
    data: bytes | None,
) -> bytes:
    """``corral run --json`` through the server: one JSON line, then the end."""
    try:
        result = await sb.run(command, timeout=args.timeout, stdin=data, env=env, cwd=args.workdir)
    except errors.SpawnFailed as exc:
        status = 127 if isinstance(exc, errors.CommandNotFound) else 126
        line = json.dumps({**exc.to_dict(), "exit_code": status}) + "\n"
        return frames.frame(frames.STDOUT, line.encode()) + frames.json_frame(
            frames.END, {"exit_code": status, "status": status}
        )
    out = frames.frame(frames.STDOUT, (json.dumps(result.to_dict()) + "\n").encode())
    if "\ufffd" in result.stdout or "\ufffd" in result.stderr:  # as in-process: said
        from corral.cli.run import NOT_UTF8_NOTE

        out += frames.frame(frames.NOTE, NOT_UTF8_NOTE.encode())
    if result.truncated:
        cap = sb.policy.limits.output_bytes
        out += frames.frame(
            frames.NOTE,
            f"corral: output truncated: more than {cap} bytes on a stream, the middle was "
            "cut (raise --output-bytes, or run without --json to stream it all)".encode(),
        )
    status = _status_for_cli(result.exit_code, result.timed_out)
    return out + frames.json_frame(frames.END, {"exit_code": result.exit_code, "status": status})


async def _output_frames(stream: Any, ended: list[int]) -> AsyncIterator[bytes]:
    """A command's output as frames; its exit status lands in ``ended``. Leaving early
    (the client went: a Ctrl-C on ``corral run`` or ``exec``) ends the command as the
    library ends one (SIGTERM, the grace, SIGKILL), shielded: the server cancels a response
    whose client went with an anyio cancel scope, which cancelled every await of that
    ending too, so the command was left running (or the box lost its channel)."""
    try:
        async for event in stream:
            if isinstance(event, Exited):
                ended.append(event.code)
                continue
            kind = frames.STDOUT if isinstance(event, Stdout) else frames.STDERR
            yield frames.frame(kind, event.data)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.__aexit__(None, None, None)


async def _guarded(gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An error after the response began becomes an error frame (the status is sent)."""
    try:
        async for chunk in gen:
            yield chunk
    except errors.SandboxError as exc:
        yield frames.json_frame(frames.ERROR, error_body(exc.code, exc.message))
    except Exception as exc:  # the stream must end with a frame, not a cut connection
        logger.exception("an exec stream failed")
        yield frames.json_frame(
            frames.ERROR, error_body(errors.ErrorCode.INTERNAL_ERROR, f"the server failed: {exc}")
        )


def _frames_response(gen: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        _guarded(gen), media_type=frames.MEDIA_TYPE, headers={"cache-control": "no-store"}
    )


# ---- the app -----------------------------------------------------------------------------------
RunParser = Callable[[list[str]], argparse.Namespace]


class _CountResponses:
    """Counts each HTTP response by status class as its head is sent. Plain ASGI: Starlette's
    ``@app.middleware("http")`` runs every response body, the CLI's streamed output
    included, through a task and a memory stream of its own."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self.metrics.requests.labels(status=f"{status // 100}xx").inc()
            await send(message)

        await self.app(scope, receive, counted)


class _AnswerBugs:
    """A bug (an exception no handler took) answers with the stable error body and a
    sentence, never a bare 500; the traceback goes to the server's log.

    Plain ASGI, inside Starlette's ``ServerErrorMiddleware``: that one answers too, but
    re-raises to the server afterwards, and uvicorn then closes the connection, so a client
    that keeps its connection alive lost it with every 500. Here the exception ends with
    the answer. One raised once the response has started cannot be answered and goes on
    (the connection must close: its response is cut)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:  # the caller left mid-request (^C in an upload): no bug
            where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
            logger.info("the client left during %s", where)
        except Exception as exc:
            if started:
                raise
            where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
            logger.exception("the server failed on %s", where)
            answer = AsciiJSONResponse(
                error_body(
                    errors.ErrorCode.INTERNAL_ERROR,
                    f"the server failed on {where} ({type(exc).__name__}: {exc}); its log "
                    "has the details",
                ),
                status_code=500,
            )
            await answer(scope, receive, send)


def build_api(  # noqa: C901
    boxes: Boxes, metrics: Metrics, *, info: dict[str, Any], parse_run: RunParser
) -> FastAPI:
    """The FastAPI app over ``boxes`` (authentication is the Guard's, in front of it).
    ``parse_run`` parses ``corral run``'s arguments (the CLI's parser, raising corral errors)."""
    app = FastAPI(
        title="corral serve",
        version=API_VERSION,
        description="Linux sandboxes for AI agents, over HTTP. Errors: "
        '{"error": {"code", "message", "retryable"}}.',
        docs_url=None,
        redoc_url=None,
        default_response_class=AsciiJSONResponse,  # names that are not UTF-8 (see its doc)
    )
    started = time.time()

    @app.exception_handler(errors.SandboxError)
    async def sandbox_error(request: Request, exc: errors.SandboxError) -> AsciiJSONResponse:
        return AsciiJSONResponse(
            error_body(exc.code, exc.message), status_code=status_for(exc.code)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """No route, or not this method: the same error body as every other refusal."""
        if exc.status_code == 404:
            message = (
                f"no such API route: {request.method} {request.url.path} (the routes are in "
                "/openapi.json)"
            )
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method} (see /openapi.json)"
        else:
            message = str(exc.detail)
        return AsciiJSONResponse(
            error_body(errors.ErrorCode.INVALID_INPUT, message),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> AsciiJSONResponse:
        return AsciiJSONResponse(
            error_body(errors.ErrorCode.INVALID_INPUT, f"bad request: {_problems(exc.errors())}"),
            status_code=400,
        )

    app.add_middleware(_AnswerBugs)
    app.add_middleware(_CountResponses, metrics=metrics)  # outside: counts the 500 too

    # -- server --------------------------------------------------------------------------------
    @app.get("/v1/health", tags=["server"])
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/info", tags=["server"])
    async def server_info(request: Request) -> dict[str, Any]:
        """The server, and ``scope``: what the caller's token may do (``read``: look only;
        ``operate``: everything), which the dashboard shows its buttons by."""
        scope = getattr(request.state, "corral_scope", "operate")
        return {
            **info,
            "uptime_secs": time.time() - started,
            "boxes": len(boxes.matching()),
            "scope": scope,
        }

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def prometheus() -> Response:
        boxes.observe()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    add_dashboard(app, boxes.audit, Approvals())

    # -- boxes ---------------------------------------------------------------------------------
    @app.post("/v1/boxes", tags=["boxes"], status_code=201)
    async def create_box(body: BoxCreate) -> BoxOut:
        policy, workspace = _policy(body.policy), body.workspace
        force = body.allow_dangerous_workspace
        if body.cli_argv is not None:
            from corral.cli.run import plan_run

            if body.policy is not None or body.workspace is not None:
                raise errors.SandboxError(
                    "give cli_argv or policy/workspace, not both: cli_argv's flags make the "
                    "policy and the workspace (--policy FILE, --workspace DIR)",
                    code=errors.ErrorCode.INVALID_INPUT,
                )

            args = parse_run([*body.cli_argv, "--", "true"])
            plan = plan_run(args)
            policy, workspace = plan.policy, plan.workspace
            force = force or bool(getattr(args, "force_workspace", False))
        held = await boxes.create(
            policy,
            workspace=workspace,
            labels=body.labels,
            ttl=body.ttl_secs,
            idle_timeout=body.idle_timeout_secs,
            allow_dangerous_workspace=force,
        )
        return BoxOut(**held.describe())

    @app.get("/v1/boxes", tags=["boxes"])
    async def list_boxes(
        request: Request,
        label: Annotated[list[str] | None, Query(description="K=V, all must match")] = None,
    ) -> list[BoxOut]:
        exact = _exact_all(request, "label", label or [])
        wanted = dict(item.partition("=")[::2] for item in exact)
        return [BoxOut(**h.describe()) for h in boxes.matching(wanted)]

    @app.get("/v1/boxes/{box_id}", tags=["boxes"])
    async def get_box(box_id: str) -> BoxOut:
        return BoxOut(**boxes.get(box_id, touch=False).describe())

    @app.delete("/v1/boxes/{box_id}", tags=["boxes"], status_code=204)
    async def delete_box(box_id: str) -> Response:
        await boxes.remove(box_id)
        return Response(status_code=204)

    @app.post("/v1/boxes/{box_id}/pause", tags=["boxes"])
    async def pause_box(box_id: str) -> BoxOut:
        """Stop every process of the box where it stands (the cgroup freezer)."""
        held = boxes.get(box_id)
        await held.sandbox.pause()
        return BoxOut(**held.describe())

    @app.post("/v1/boxes/{box_id}/resume", tags=["boxes"])
    async def resume_box(box_id: str) -> BoxOut:
        held = boxes.get(box_id)
        await held.sandbox.resume()
        return BoxOut(**held.describe())

    @app.post("/v1/boxes/{box_id}/snapshot", tags=["boxes"])
    async def snapshot_box(box_id: str, body: SnapshotIn) -> SnapshotOut:
        """The box's writable root (and with ``workspace``, its workspace) as an image in
        the store: filesystem state only."""
        snap = await boxes.get(box_id).sandbox.snapshot(
            body.name, processes=body.processes, workspace=body.workspace
        )
        return SnapshotOut(**snap.to_dict())

    @app.post("/v1/boxes/{box_id}/fork", tags=["boxes"], status_code=201)
    async def fork_box(box_id: str, body: ForkIn) -> list[BoxOut]:
        """``n`` new boxes from the box's filesystem state, held by the server."""
        held = boxes.get(box_id)
        with boxes.reserve(body.n):  # the cap counts forks too
            forks = await held.sandbox.fork(
                body.n, processes=body.processes, workspace=body.workspace
            )
            adopted = [boxes.adopt(sb, {**held.labels, **body.labels}) for sb in forks]
        return [BoxOut(**h.describe()) for h in adopted]

    @app.get("/v1/boxes/{box_id}/info", tags=["boxes"])
    async def box_info(box_id: str) -> dict[str, Any]:
        return await box(box_id, look=True).sandbox.info()

    def box(box_id: str, *, look: bool = False) -> HeldBox:
        """The box; ``look``: a read-only look at its state (processes, sessions, info,
        the file tree), which is not activity: its idle timer goes on (a dashboard tab
        polling a box must not keep it alive)."""
        return boxes.get(box_id, touch=not look)

    # -- commands ------------------------------------------------------------------------------
    @app.post("/v1/boxes/{box_id}/run", tags=["commands"], response_model=None)
    async def run(box_id: str, body: RunIn) -> ResultOut | ProcessOut:
        held = box(box_id)
        sb = held.sandbox
        stdin = _stdin_of(body)
        if body.background:
            spawn_stdin: str | bytes | None = "pipe" if body.stdin_pipe else stdin
            proc = await sb.spawn(body.cmd, cwd=body.cwd, env=body.env, stdin=spawn_stdin)
            return ProcessOut(**proc.info().to_dict())
        result = await sb.run(
            body.cmd, timeout=body.timeout, cwd=body.cwd, env=body.env, stdin=stdin
        )
        if (closed := _closed_by_server(boxes, sb, held, result.ended)) is not None:
            raise closed
        metrics.ended(result.ended, result.timed_out)
        return ResultOut(**result.to_dict())

    @app.post("/v1/pools/run", tags=["commands"])
    async def pool_run(body: PoolRunIn) -> ResultOut:
        """One command in a warm box of the policy's pool, closed afterwards (a one-shot,
        as ``SandboxPool.run``): the fastest way to a fresh box."""
        if body.background:
            raise errors.SandboxError(
                "a pool runs one-shots: make a box (POST /v1/boxes) for background work",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        stdin = _stdin_of(body)
        async with boxes.one_shot(_policy(body.policy), body.workspace) as sb:
            result = await sb.run(
                body.cmd, timeout=body.timeout, cwd=body.cwd, env=body.env, stdin=stdin
            )
        metrics.ended(result.ended, result.timed_out)
        return ResultOut(**result.to_dict())

    @app.post(
        "/v1/boxes/{box_id}/exec",
        tags=["commands"],
        response_class=StreamingResponse,
        responses={200: {"content": {frames.MEDIA_TYPE: {}}}},
    )
    async def exec_stream(
        box_id: str,
        request: Request,
        cmd: Annotated[list[str], Query(description="argv, one value per argument")],
        timeout: Annotated[float | None, Query(gt=0, allow_inf_nan=False)] = None,
        cwd: str | None = None,
        env: Annotated[list[str] | None, Query(description="K=V")] = None,
        stdin: Annotated[bool, Query(description="the request body is stdin")] = False,
    ) -> StreamingResponse:
        held = box(box_id)
        sb = held.sandbox
        cmd = _exact_all(request, "cmd", cmd)
        cwd = None if cwd is None else _exact(request, "cwd", cwd)
        variables = _env_items(_exact_all(request, "env", env or []))
        data = await _body(request) if stdin else None
        gen = _stream_command(
            sb,
            cmd,
            cwd=cwd,
            env=variables or None,
            timeout=timeout,
            stdin=data,
            metrics=metrics,
            closed_by_server=lambda how: _closed_by_server(boxes, sb, held, how),
        )
        return _frames_response(gen)

    @app.post(
        "/v1/cli/run",
        tags=["commands"],
        response_class=StreamingResponse,
        responses={200: {"content": {frames.MEDIA_TYPE: {}}}},
    )
    async def cli_run(request: Request) -> StreamingResponse:
        """``corral run ARGV`` in a box of a warm pool (the CLI's path through the server).
        The JSON body (``CliRunIn``) comes in the ``X-Corral-Run`` header so that the body
        can be the command's stdin."""
        raw = request.headers.get("x-corral-run", "")
        try:
            # Python's own JSON parser: it keeps an escaped lone surrogate, which is how a
            # command line's non-UTF-8 bytes travel (os.fsdecode's surrogateescape), where
            # pydantic's refuses the whole header.
            spec = CliRunIn.model_validate(json.loads(raw))
        except ValidationError as exc:
            raise errors.SandboxError(
                f"bad X-Corral-Run header: {_problems(exc.errors())}",
                code=errors.ErrorCode.INVALID_INPUT,
            ) from None
        except ValueError as exc:  # not JSON
            raise errors.SandboxError(
                f"bad X-Corral-Run header: {exc}", code=errors.ErrorCode.INVALID_INPUT
            ) from None
        args = parse_run(spec.argv)
        from corral.cli.run import plan_run
        from corral.net.cli import published_lines

        notes: list[str] = []  # the presets picked: said to the CLI, not into this log
        plan = plan_run(args, say=notes.append)
        force = bool(getattr(args, "force_workspace", False))
        data = await _body(request) if spec.stdin else None

        async def gen() -> AsyncIterator[bytes]:
            for note in notes:
                yield frames.frame(frames.NOTE, note.encode("utf-8", "backslashreplace"))
            async with boxes.one_shot(
                plan.policy, plan.workspace, allow_dangerous_workspace=force
            ) as sb:
                for warning in sb.warnings:
                    note = f"corral: warning: {warning}"  # may name a path not in UTF-8
                    yield frames.frame(frames.NOTE, note.encode("utf-8", "backslashreplace"))
                for line in published_lines(sb):  # where each -p 0:PORT landed
                    yield frames.frame(frames.NOTE, line.encode())
                command = plan.command or list(
                    (sb.image_config.cmd if sb.image_config else None) or ()
                )
                if not command:
                    raise errors.SandboxError(
                        "give a command after --, e.g. corral run -- make test (the image "
                        "names no Cmd or Entrypoint)",
                        code=errors.ErrorCode.INVALID_INPUT,
                    )
                if args.json:
                    yield await _captured(sb, args, command, plan.env, data)
                    return
                async for chunk in _stream_command(
                    sb,
                    command,
                    cwd=args.workdir,
                    env=plan.env,
                    timeout=args.timeout,
                    stdin=data,
                    metrics=metrics,
                    closed_by_server=lambda how: _closed_by_server(boxes, sb, None, how),
                ):
                    yield chunk

        return _frames_response(gen())

    # -- processes -----------------------------------------------------------------------------
    def process(box_id: str, pid: int, *, look: bool = False) -> Process:
        return box(box_id, look=look).sandbox.process(pid)

    @app.get("/v1/boxes/{box_id}/processes", tags=["processes"])
    async def list_processes(box_id: str) -> list[ProcessOut]:
        return [ProcessOut(**p.to_dict()) for p in box(box_id, look=True).sandbox.processes()]

    @app.get("/v1/boxes/{box_id}/processes/{pid}", tags=["processes"])
    async def get_process(box_id: str, pid: int) -> ProcessOut:
        return ProcessOut(**process(box_id, pid, look=True).info().to_dict())

    @app.post("/v1/boxes/{box_id}/processes/{pid}/wait", tags=["processes"])
    async def wait_process(
        box_id: str,
        pid: int,
        timeout: Annotated[float | None, Query(gt=0, allow_inf_nan=False)] = None,
    ) -> dict[str, Any]:
        held = box(box_id)
        waited = await held.sandbox.process(pid).wait(timeout)
        if waited.status == "exited":
            how = _how_ended(waited.exit_code or 0, timed_out=False, oom=False)
            if (closed := _closed_by_server(boxes, held.sandbox, held, how)) is not None:
                raise closed
        return waited.to_dict()

    @app.get(
        "/v1/boxes/{box_id}/processes/{pid}/output",
        tags=["processes"],
        response_class=Response,
        responses={
            200: {
                "content": {"application/octet-stream": {}},
                "headers": {
                    "x-corral-truncated": {
                        "description": "1 when the middle of a stream of the process was cut "
                        "(over the box's output cap)",
                        "schema": {"type": "string", "enum": ["0", "1"]},
                    },
                    "x-corral-cut-at": {
                        "description": "this stream was cut: the offset in the body where "
                        "its middle is missing",
                        "schema": {"type": "integer"},
                    },
                    "x-corral-cut-bytes": {
                        "description": "this stream was cut: how many bytes are missing "
                        "at x-corral-cut-at",
                        "schema": {"type": "integer"},
                    },
                },
            }
        },
    )
    async def process_output(
        box_id: str, pid: int, stream: Literal["stdout", "stderr"] = "stdout"
    ) -> Response:
        """What a process wrote so far: the first and last halves of the output cap when
        it wrote more (``x-corral-cut-at`` and ``x-corral-cut-bytes`` say where the middle is
        missing and how much of it)."""
        proc = process(box_id, pid, look=True)
        headers = {"x-corral-truncated": "1" if proc.truncated else "0"}
        cut = proc.output_cut(stream)
        if cut is not None:
            headers["x-corral-cut-at"], headers["x-corral-cut-bytes"] = str(cut[0]), str(cut[1])
        return Response(
            proc.output_bytes(stream), media_type="application/octet-stream", headers=headers
        )

    @app.get(
        "/v1/boxes/{box_id}/processes/{pid}/follow",
        tags=["processes"],
        response_class=StreamingResponse,
        responses={200: {"content": {frames.MEDIA_TYPE: {}}}},
    )
    async def follow_process(box_id: str, pid: int) -> StreamingResponse:
        """Output captured so far, then live, then the end (``corral logs -f``), or the
        error saying the server closed the box under the process."""
        held = box(box_id)
        proc = held.sandbox.process(pid)

        async def gen() -> AsyncIterator[bytes]:
            queue = proc.subscribe(hold=False)  # a watcher: it must not slow the process
            try:
                # Taken with the subscription, no await between: the queue holds exactly
                # what comes after these.
                so_far = proc.output_bytes("stdout"), proc.output_bytes("stderr")
                cut = proc.truncated
                yield frames.frame(frames.STDOUT, so_far[0])
                yield frames.frame(frames.STDERR, so_far[1])
                if cut:  # what came before was kept head and tail only: say so
                    yield frames.frame(frames.NOTE, truncated_note(box_id).encode())
                while True:
                    kind, data = await queue.get()
                    if kind == "exit":
                        assert isinstance(data, int)
                        code = data
                        how = _how_ended(code, timed_out=False, oom=False)
                        if closed := _closed_by_server(boxes, held.sandbox, held, how):
                            raise closed
                        yield frames.json_frame(
                            frames.END, {"exit_code": code, "status": _status_for_cli(code, False)}
                        )
                        return
                    if isinstance(data, Skipped):  # this reader fell 4 MiB behind
                        note = f"corral: {data.size} bytes of output skipped (this reader fell "
                        note += "behind; the process was not slowed)"
                        yield frames.frame(frames.NOTE, note.encode())
                        continue
                    assert isinstance(data, bytes)
                    yield frames.frame(frames.STDERR if kind == "stderr" else frames.STDOUT, data)
            finally:
                proc.unsubscribe(queue)

        return _frames_response(gen())

    @app.post("/v1/boxes/{box_id}/processes/{pid}/signal", tags=["processes"])
    async def signal_process(box_id: str, pid: int, body: SignalIn) -> dict[str, bool]:
        return {"delivered": await process(box_id, pid).signal(body.signal, group=body.group)}

    @app.post("/v1/boxes/{box_id}/processes/{pid}/stdin", tags=["processes"])
    async def write_stdin(
        box_id: str, pid: int, request: Request, eof: bool = False
    ) -> dict[str, int]:
        proc = process(box_id, pid)
        sent = 0
        async for chunk in request.stream():
            if chunk:
                await proc.write(chunk)
                sent += len(chunk)
        if eof:
            await proc.close_stdin()
        return {"bytes": sent}

    @app.get("/v1/boxes/{box_id}/processes/{pid}/stats", tags=["processes"])
    async def process_stats(box_id: str, pid: int) -> dict[str, Any]:
        return (await process(box_id, pid, look=True).stats()).to_dict()

    # -- files ---------------------------------------------------------------------------------
    @app.get("/v1/boxes/{box_id}/files", tags=["files"])
    async def list_files(box_id: str, request: Request, path: str = ".") -> list[dict[str, Any]]:
        path = _exact(request, "path", path)
        return [f.to_dict() for f in await box(box_id, look=True).sandbox.files.list(path)]

    @app.get("/v1/boxes/{box_id}/files/stat", tags=["files"])
    async def stat_file(box_id: str, path: str, request: Request) -> dict[str, Any]:
        path = _exact(request, "path", path)
        found = await box(box_id, look=True).sandbox.files.stat(path)
        if found is None:
            raise errors.FileNotFound(f"{path}: no such file or directory in the box")
        return found.to_dict()

    @app.get(
        "/v1/boxes/{box_id}/files/content",
        tags=["files"],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def read_file(
        box_id: str,
        path: str,
        request: Request,
        offset: Annotated[int, Query(ge=0)] = 0,
        length: Annotated[int | None, Query(ge=0)] = None,
    ) -> StreamingResponse:
        path = _exact(request, "path", path)
        files = box(box_id).sandbox.files
        want = CHUNK if length is None else min(CHUNK, length)  # length=0: nothing
        first = await files.read(path, offset=offset, length=want)

        async def gen() -> AsyncIterator[bytes]:
            at, left = offset + len(first), None if length is None else length - len(first)
            yield first
            piece = first
            while len(piece) == CHUNK and (left is None or left > 0):
                want = CHUNK if left is None else min(CHUNK, left)
                piece = await files.read(path, offset=at, length=want)
                if not piece:
                    return
                at += len(piece)
                if left is not None:
                    left -= len(piece)
                yield piece

        return StreamingResponse(gen(), media_type="application/octet-stream")

    @app.put("/v1/boxes/{box_id}/files/content", tags=["files"])
    async def write_file(
        box_id: str, path: str, request: Request, append: bool = False
    ) -> dict[str, Any]:
        path = _exact(request, "path", path)
        files = box(box_id).sandbox.files
        pending = bytearray()
        received = size = 0
        first = True
        async for chunk in request.stream():
            pending += chunk
            received += len(chunk)
            if len(pending) >= CHUNK:
                size = await files.write(path, bytes(pending), append=append or not first)
                pending.clear()
                first = False
        if pending or first:
            size = await files.write(path, bytes(pending), append=append or not first)
        # Files.write answers the file's new size (a sum of those counted each 4 MiB
        # chunk's running size): ``bytes`` is what arrived, ``size`` the file's length now.
        return {"path": path, "bytes": received, "size": size}

    @app.delete("/v1/boxes/{box_id}/files", tags=["files"], status_code=204)
    async def remove_file(
        box_id: str, path: str, request: Request, recursive: bool = False
    ) -> Response:
        path = _exact(request, "path", path)
        await box(box_id).sandbox.files.remove(path, recursive=recursive)
        return Response(status_code=204)

    @app.post("/v1/boxes/{box_id}/files/mkdir", tags=["files"], status_code=204)
    async def make_dir(box_id: str, path: str, request: Request, parents: bool = True) -> Response:
        path = _exact(request, "path", path)
        await box(box_id).sandbox.files.mkdir(path, parents=parents)
        return Response(status_code=204)

    # -- terminals -----------------------------------------------------------------------------
    @app.post("/v1/boxes/{box_id}/sessions", tags=["terminals"], status_code=201)
    async def open_session(box_id: str, body: SessionIn) -> SessionOut:
        sb = box(box_id).sandbox
        from corral.sessions.terminal import default_shell

        shell = body.shell or await default_shell(sb.run)
        session = await sb.shell(shell, env=body.env, cols=body.cols, rows=body.rows, cwd=body.cwd)
        return _session_out(sb, session.session_id)

    @app.get("/v1/boxes/{box_id}/sessions", tags=["terminals"])
    async def list_sessions(box_id: str) -> list[SessionOut]:
        sb = box(box_id, look=True).sandbox
        return [_session_out(sb, s.session_id) for s in sb.sessions()]

    @app.post("/v1/boxes/{box_id}/sessions/{session_id}/write", tags=["terminals"])
    async def session_write(box_id: str, session_id: str, body: WriteIn) -> dict[str, int]:
        raw = text_bytes(body.data)  # lone surrogates: the bytes that are not UTF-8
        await box(box_id).sandbox.session(session_id).write(bytes(raw))
        return {"bytes": len(raw)}

    @app.post("/v1/boxes/{box_id}/sessions/{session_id}/expect", tags=["terminals"])
    async def session_expect(box_id: str, session_id: str, body: ExpectIn) -> dict[str, Any]:
        held = box(box_id)
        session = held.sandbox.session(session_id)
        with held.waited_on():
            match = await session.expect(body.pattern, timeout=body.timeout)
        return match.to_dict()

    @app.get("/v1/boxes/{box_id}/sessions/{session_id}/output", tags=["terminals"])
    async def session_output(box_id: str, session_id: str) -> dict[str, str]:
        return {"output": box(box_id).sandbox.session(session_id).read()}

    @app.delete("/v1/boxes/{box_id}/sessions/{session_id}", tags=["terminals"])
    async def close_session(box_id: str, session_id: str) -> dict[str, int | None]:
        code = await box(box_id).sandbox.session(session_id).close()
        return {"exit_code": code}

    @app.websocket("/v1/boxes/{box_id}/exec/ws")
    async def exec_ws(websocket: WebSocket, box_id: str) -> None:
        """A command with its stdin open, over a WebSocket (``?cmd=`` as for ``/exec``):
        binary messages out are frames (:mod:`corral.client.frames`, one per message, ending
        with the end frame); binary messages in are stdin; text ``{"eof": true}`` closes
        stdin, ``{"signal": "SIGINT"}`` signals the command. The socket closing ends it."""
        params = websocket.query_params
        try:
            held = box(box_id)
            sb = held.sandbox
            timeout = _timeout_param(params.get("timeout"))
            variables = _env_items(_exact_all(websocket, "env", params.getlist("env")))
            cwd = params.get("cwd")
            oom_before = sb.oom_kills()
            stream = await sb.exec_stream(
                _exact_all(websocket, "cmd", params.getlist("cmd")),
                stdin="pipe",
                cwd=None if cwd is None else _exact(websocket, "cwd", cwd),
                env=variables or None,
                timeout=timeout,
            )
        except (errors.SandboxError, ValueError) as exc:
            code = getattr(exc, "code", errors.ErrorCode.INVALID_INPUT)
            await websocket.accept()
            await websocket.send_bytes(
                frames.json_frame(frames.ERROR, error_body(code, getattr(exc, "message", str(exc))))
            )
            await websocket.close(code=1000)
            return
        await websocket.accept()
        ended: list[int] = []

        async def pump() -> None:
            async for chunk in _output_frames(stream, ended):
                await websocket.send_bytes(chunk)
            code, timed_out = ended[0] if ended else -9, bool(stream.timed_out)
            how = _how_ended(code, timed_out, sb.oom_kills() > oom_before)
            if (closed := _closed_by_server(boxes, sb, held, how)) is not None:
                body = error_body(closed.code, closed.message)
                await websocket.send_bytes(frames.json_frame(frames.ERROR, body))
            else:
                metrics.ended(how, timed_out)
                end = {"exit_code": code, "timed_out": timed_out, "ended": how}
                await websocket.send_bytes(frames.json_frame(frames.END, end))
            await websocket.close(code=1000)

        feeder = asyncio.ensure_future(_ws_input(websocket, stream))
        pumping = asyncio.ensure_future(pump())
        try:
            await asyncio.wait({feeder, pumping}, return_when=asyncio.FIRST_COMPLETED)
            if not pumping.done():  # the client went first, maybe from a silent command
                pumping.cancel()  # leaving the stream's `async with` ends the command
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, asyncio.CancelledError):
                await pumping  # the command's end (TERM, the grace, KILL) included
        finally:
            feeder.cancel()
            pumping.cancel()

    @app.websocket("/v1/boxes/{box_id}/sessions/{session_id}/attach")
    async def attach(websocket: WebSocket, box_id: str, session_id: str) -> None:
        """A person's terminal on an agent's session: binary messages are keystrokes in and
        screen bytes out; a text message ``{"resize": [cols, rows]}`` resizes. The session
        goes on when the socket closes (detach), and gets the window size it had back when
        the last person leaves, as ``corral attach`` gives it back."""
        try:
            session = box(box_id).sandbox.session(session_id)
        except errors.SandboxError as exc:
            await deny_websocket(websocket, exc)
            return
        await websocket.accept()
        before = (session.cols, session.rows)
        out: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1024)

        def watcher(chunk: bytes | None) -> None:
            with contextlib.suppress(asyncio.QueueFull):  # a stalled browser drops screens
                out.put_nowait(chunk)

        recent = session.recent_output()
        unwatch = session.watch(watcher)

        async def pump_out() -> None:
            if recent:
                await websocket.send_bytes(recent)
            while (chunk := await out.get()) is not None:
                await websocket.send_bytes(chunk)
            await websocket.close(code=1000, reason="session ended")

        sender = asyncio.ensure_future(pump_out())
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes"):
                    await session.write(message["bytes"])
                elif message.get("text"):
                    await _control(session, message["text"])
        except (WebSocketDisconnect, errors.SandboxError):
            pass
        finally:
            sender.cancel()
            # Before unwatch, so whoever waits for the detach sees the size already back.
            try:
                last = session.attached == 1
                if last and not session.closed and before != (session.cols, session.rows):
                    with contextlib.suppress(errors.SandboxError):
                        await session.resize(*before)
            finally:
                unwatch()

    from corral.server.ports import add_port_routes

    add_port_routes(app, boxes)

    @app.websocket("/{path:path}")  # last: only what no route above took
    async def no_websocket_route(websocket: WebSocket, path: str) -> None:
        """An unknown WebSocket route gets the body an unknown HTTP route gets (a 404)."""
        message = f"no such WebSocket route: /{path} (the routes are in /openapi.json)"
        body = error_body(errors.ErrorCode.INVALID_INPUT, message)
        if "websocket.http.response" in (websocket.scope.get("extensions") or {}):
            await websocket.send_denial_response(AsciiJSONResponse(body, status_code=404))
        else:
            await websocket.close(code=4404, reason="no such route")

    return app


def _env_items(items: list[str]) -> dict[str, str]:
    """``env=K=V`` query values as a dict; an item without ``=`` or a name is refused."""
    variables: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise errors.SandboxError(
                f"env={item!r}: give NAME=VALUE", code=errors.ErrorCode.INVALID_INPUT
            )
        variables[name] = value
    return variables


def _timeout_param(text: str | None) -> float | None:
    """``?timeout=`` of the WebSocket routes (no FastAPI validation there): a finite number
    of seconds greater than 0."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise errors.SandboxError(
            f"timeout={text!r}: give a number of seconds greater than 0",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return value


async def _ws_input(websocket: WebSocket, stream: Any) -> None:
    """stdin and control messages of ``/exec/ws``; returns when the client goes (only
    then: input the command no longer takes is dropped, the socket still counts)."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes"):
                with contextlib.suppress(errors.SandboxError):  # its stdin closed, it ended
                    await stream.write(message["bytes"])
            elif message.get("text"):
                try:
                    control = json.loads(message["text"])
                    if control.get("eof"):
                        await stream.close_stdin()
                    if "signal" in control:
                        await stream.signal(control["signal"])
                except (ValueError, TypeError, AttributeError, errors.SandboxError) as exc:
                    # A bad control message (an unknown signal, not JSON) is told, and the
                    # stream goes on: the messages after it still count.
                    what = getattr(exc, "message", None) or f"not a control message: {exc}"
                    note = f"corral: ignored {message['text'][:80]!r}: {what}\n"
                    await websocket.send_bytes(frames.frame(frames.NOTE, note.encode()))


async def _control(session: Any, text: str) -> None:
    """A terminal's text message: ``{"resize": [cols, rows]}`` or ``{"data": text}``; one it
    cannot take (not JSON, not numbers, ``1e400``'s infinity) is ignored, the terminal kept."""
    with contextlib.suppress(ValueError, TypeError, KeyError, OverflowError):
        msg = json.loads(text)
        if "resize" in msg:
            cols, rows = (int(v) for v in msg["resize"])
            await session.resize(max(10, min(cols, 1000)), max(2, min(rows, 1000)))
        elif "data" in msg:
            await session.write(str(msg["data"]))
