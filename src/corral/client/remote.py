"""The remote SDK: boxes held by a ``corral serve``, with the in-process API.

::

    import corral

    async with corral.connect("http://127.0.0.1:7420", token=TOKEN) as remote:
        async with remote.Sandbox(policy) as sb:          # was: corral.Sandbox(policy)
            result = await sb.run("make test")
            await sb.files.write("notes.txt", "hi")
            async for event in sb.exec_stream(["pytest", "-x"]):
                ...

``RemoteSandbox`` has ``run``, ``spawn`` (a ``RemoteProcess`` with ``wait``, ``output``,
``signal``, ``write``...), ``exec_stream``, ``files`` (``read``, ``write``, ``list``, ``stat``,
``exists``, ``mkdir``, ``remove``), ``shell`` (a ``RemoteSession`` with ``write``,
``expect``, ``read``, ``close``), ``info``, ``processes`` and ``warnings``; results are the
library's own types and errors its own classes (:func:`corral.errors.from_code`), with
``retryable`` for failures of the infrastructure. What cannot be synchronous over a network
is a coroutine here: ``processes()``, ``process(pid)``, ``output()``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote, urlencode, urlsplit

import httpx

from corral import errors
from corral.client import frames
from corral.client.fast import default_socket, runtime_base, token_file_name
from corral.models import (
    CommandResult,
    FileInfo,
    NetworkRefusal,
    ProcessInfo,
    Snapshot,
    SnapshotProcesses,
    WaitResult,
)
from corral.output import text_bytes
from corral.policy import Policy
from corral.streaming import ExecEvent, Exited, Stderr, Stdout

__all__ = [
    "Remote",
    "RemoteExecStream",
    "RemoteFiles",
    "RemotePool",
    "RemoteProcess",
    "RemoteSandbox",
    "RemoteSession",
    "connect",
]

Command = str | list[str]


def connect(url: str | None = None, token: str | None = None, *, timeout: float = 300.0) -> Remote:
    """A client of the ``corral serve`` at ``url`` (``http://HOST:PORT`` or
    ``unix:/path/serve.sock``; default ``$CORRAL_HOST``, else the default socket). The token
    defaults to ``$CORRAL_TOKEN``, else the token file the server wrote for that address."""
    return Remote(
        url or os.environ.get("CORRAL_HOST") or f"unix:{default_socket()}", token, timeout=timeout
    )


def _with_query(path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> str:
    """``path?query``, each text value written as the bytes ``os.fsencode`` makes of it:
    httpx writes UTF-8, which a name that is not UTF-8 (a ``str`` with lone surrogates, as
    the library hands such names out) does not survive; the server reads them back (its
    ``api._exact``). Other values as httpx writes them (True: ``true``, None: empty); a list
    repeats its key."""
    items = params.items() if isinstance(params, Mapping) else params
    pairs: list[tuple[str, bytes]] = []
    for key, value in items:
        for one in value if isinstance(value, list | tuple) else [value]:
            if one is None:
                pairs.append((key, b""))
            elif isinstance(one, bool):
                pairs.append((key, b"true" if one else b"false"))
            else:
                pairs.append((key, os.fsencode(one) if isinstance(one, str) else str(one).encode()))
    query = urlencode(pairs, quote_via=quote)
    return f"{path}?{query}" if query else path


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        err = response.json()["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "server_error", f"HTTP {response.status_code}: {response.text[:200]}"
    raise errors.from_code(code, message)


def _result(data: Mapping[str, Any]) -> CommandResult:
    fields = dict(data)
    fields["duration"] = float(fields.pop("duration_ms", 0.0)) / 1000
    fields["network_refusals"] = tuple(
        NetworkRefusal(**r) for r in fields.get("network_refusals") or ()
    )
    return CommandResult(**fields)


def _run_body(
    cmd: Command,
    *,
    timeout: float | None,
    cwd: str | None,
    env: dict[str, str] | None,
    stdin: bytes | str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd, "timeout": timeout, "cwd": cwd, "env": env}
    if isinstance(stdin, bytes):
        body["stdin_base64"] = base64.b64encode(stdin).decode()
    else:
        body["stdin"] = stdin
    return body


def _checked(result: CommandResult, cmd: Command, check: bool) -> CommandResult:
    if check and not result.ok:
        raise errors.CommandFailed(f"{cmd!r} exited with status {result.exit_code}", result)
    return result


class Remote:
    """One server; makes :class:`RemoteSandbox` and :class:`RemotePool` objects."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 300.0) -> None:
        self.url = url
        transport: httpx.AsyncBaseTransport | None = None
        if url.startswith("unix:"):
            transport = httpx.AsyncHTTPTransport(uds=url[5:])
            base = "http://localhost"
        else:
            base = url.rstrip("/")
            if token is None and not os.environ.get("CORRAL_TOKEN"):
                token = _token_file(base)
        token = token or os.environ.get("CORRAL_TOKEN") or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=base, transport=transport, headers=headers, timeout=timeout
        )

    async def __aenter__(self) -> Remote:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if "params" in kwargs:
            path = _with_query(path, kwargs.pop("params"))
        if "json" in kwargs:
            # JSON with every non-ASCII character escaped, as the stdlib writes it: httpx
            # writes UTF-8, which cannot carry a lone surrogate, and that is how a command
            # line or a path holds bytes that are not UTF-8 (os.fsdecode), as in-process.
            body = json.dumps(kwargs.pop("json"), allow_nan=False).encode()
            kwargs["content"] = body
            kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Type": "application/json"}
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise errors.ServerUnavailable(
                f"corral serve at {self.url} did not answer ({exc}); is it running?"
            ) from None
        _raise_for(response)
        return response

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.call(method, path, **kwargs)
        return response.json() if response.content else None

    def Sandbox(
        self,
        policy: Policy | str | os.PathLike[str] | None = None,
        *,
        workspace: str | os.PathLike[str] | None = None,
        labels: Mapping[str, str] | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        allow_dangerous_workspace: bool = False,
    ) -> RemoteSandbox:
        return RemoteSandbox(
            self,
            _policy(policy),
            workspace=None if workspace is None else os.path.abspath(workspace),
            labels=dict(labels or {}),
            ttl=ttl,
            idle_timeout=idle_timeout,
            allow_dangerous_workspace=allow_dangerous_workspace,
        )

    def SandboxPool(
        self, policy: Policy | str | os.PathLike[str] | None = None, *, size: int = 2
    ) -> RemotePool:
        """The server's warm pool for ``policy``. ``size`` is checked as in-process, but the
        server keeps the number of warm boxes its ``corral serve --pool-size`` says: one pool
        per policy serves every client of it."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise errors.SandboxError(
                f"pool size must be at least 1, got {size!r}", code=errors.ErrorCode.INVALID_INPUT
            )
        return RemotePool(self, _policy(policy))

    def approver(self, *, box: str | None = None, timeout: float = 300.0) -> Any:
        """An approver for the tools layer (``Toolbox(..., approver=...)``) that asks a person
        on the server's dashboard; unanswered within ``timeout`` seconds means no."""

        async def ask(request: Any) -> bool:
            answer = await self.json(
                "POST",
                "/v1/approvals",
                json={
                    "tool": request.tool,
                    "command_line": request.command_line,
                    "reason": request.reason,
                    "box": box,
                    "timeout_secs": timeout,
                },
                timeout=timeout + 30,
            )
            return bool(answer["approved"])

        return ask

    async def boxes(self, labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        data: list[dict[str, Any]] = await self.json("GET", "/v1/boxes", params=params)
        return data

    async def info(self) -> dict[str, Any]:
        data: dict[str, Any] = await self.json("GET", "/v1/info")
        return data


def _token_file(base: str) -> str | None:
    parts = urlsplit(base)
    if not parts.hostname:
        return None
    path = os.path.join(runtime_base(), token_file_name(parts.hostname, parts.port or 80))
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _policy(policy: Policy | str | os.PathLike[str] | None) -> Policy:
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    return Policy.load(policy)


class RemotePool:
    """One-shot runs in warm boxes the server keeps for this policy."""

    def __init__(self, remote: Remote, policy: Policy) -> None:
        self.remote = remote
        self.policy = policy

    async def __aenter__(self) -> RemotePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def run(
        self,
        cmd: Command,
        *,
        workspace: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        check: bool = False,
    ) -> CommandResult:
        """One command in a warm box of the server's pool for this policy (a one-shot)."""
        body = _run_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        body["policy"] = self.policy.model_dump(mode="json", exclude_unset=True)
        body["workspace"] = None if workspace is None else _absolute(workspace)
        result = _result(await self.remote.json("POST", "/v1/pools/run", json=body))
        return _checked(result, cmd, check)

    async def sandbox(self, workspace: str | os.PathLike[str] | None = None) -> RemoteSandbox:
        sb = self.remote.Sandbox(self.policy, workspace=workspace)
        await sb.start()
        return sb


@dataclass(frozen=True)
class RemotePort:
    """A box port exposed by the server (a :class:`corral.PublishedPort`'s fields, and URLs)."""

    box_port: int
    host_ip: str
    host_port: int
    url: str
    """The box's server from the server's host (``http://127.0.0.1:HOST_PORT/``)."""
    preview_url: str
    """The same through the server, behind its token (over a unix socket: its path part)."""


class RemoteSandbox:
    """A box on the server (made by :meth:`start`, deleted by :meth:`aclose`)."""

    def __init__(
        self,
        remote: Remote,
        policy: Policy,
        *,
        workspace: str | None,
        labels: dict[str, str],
        ttl: float | None,
        idle_timeout: float | None,
        allow_dangerous_workspace: bool,
    ) -> None:
        self.remote = remote
        self.policy = policy
        self._create: dict[str, Any] = {
            "policy": policy.model_dump(mode="json", exclude_unset=True),
            "workspace": workspace,
            "labels": labels,
            "ttl_secs": ttl,
            "idle_timeout_secs": idle_timeout,
            "allow_dangerous_workspace": allow_dangerous_workspace,
        }
        self.id: str | None = None
        self.warnings: tuple[str, ...] = ()
        self.files = RemoteFiles(self)
        self._closed = False

    def __repr__(self) -> str:
        return f"<RemoteSandbox {self.id or 'not started'} on {self.remote.url}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def path(self) -> str:
        if self.id is None:
            raise errors.SandboxClosed("the sandbox is not started")
        if self._closed:
            raise errors.SandboxClosed(f"sandbox {self.id} is closed")
        return f"/v1/boxes/{self.id}"

    async def start(self) -> None:
        if self.id is not None:
            return
        box = await self.remote.json("POST", "/v1/boxes", json=self._create)
        self.id = str(box["id"])
        self.warnings = tuple(box.get("warnings", ()))

    async def __aenter__(self) -> RemoteSandbox:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.id is None or self._closed:
            return
        self._closed = True
        try:
            await self.remote.call("DELETE", f"/v1/boxes/{self.id}")
        except errors.BoxNotFound:
            pass  # reaped already (TTL, idle timeout)

    async def info(self) -> dict[str, Any]:
        data: dict[str, Any] = await self.remote.json("GET", f"{self.path}/info")
        return data

    async def expose(self, port: int, *, host_port: int = 0) -> RemotePort:
        """Make box ``port`` reachable (``Sandbox.expose``): on the server's host at
        ``url``, and through the server, behind its auth, at ``preview_url``."""
        body = {"port": port, "host_port": host_port}
        return self._port(await self.remote.json("POST", f"{self.path}/ports", json=body))

    async def unexpose(self, port: int) -> None:
        """Stop exposing box ``port``: its host port refuses connections from now on."""
        await self.remote.call("DELETE", f"{self.path}/ports/{port}")

    async def ports(self) -> list[RemotePort]:
        """The box ports exposed or published, as :meth:`expose` answers."""
        return [self._port(p) for p in await self.remote.json("GET", f"{self.path}/ports")]

    def _port(self, data: Mapping[str, Any]) -> RemotePort:
        # Over a unix socket no URL reaches it from elsewhere: the path part, as documented.
        base = "" if self.remote.url.startswith("unix:") else str(self.remote.http.base_url)
        base = base.rstrip("/")
        return RemotePort(
            box_port=int(data["port"]),
            host_ip=str(data["host_ip"]),
            host_port=int(data["host_port"]),
            url=str(data["url"]),
            preview_url=base + str(data["preview_path"]),
        )

    async def snapshot(
        self, name: str, *, processes: SnapshotProcesses = "warn", workspace: bool = False
    ) -> Snapshot:
        """The box's filesystem state (and with ``workspace``, its workspace) as an image in
        the server's store, as ``Sandbox.snapshot``: its ref, with what it could not keep."""
        body = {"name": name, "processes": processes, "workspace": workspace}
        data = await self.remote.json("POST", f"{self.path}/snapshot", json=body)
        return Snapshot(
            str(data["ref"]),
            warnings=tuple(str(w) for w in data.get("warnings") or ()),
            workspace=bool(data.get("workspace")),
            processes=int(data.get("processes") or 0),
        )

    async def fork(
        self, n: int, *, processes: SnapshotProcesses = "warn", workspace: bool = False
    ) -> list[RemoteSandbox]:
        """``n`` new boxes on the server from this box's filesystem state, as
        ``Sandbox.fork``."""
        body = {"n": n, "processes": processes, "workspace": workspace}
        rows = await self.remote.json("POST", f"{self.path}/fork", json=body)
        forks = []
        for row in rows:
            fork = RemoteSandbox(
                self.remote,
                self.policy,
                workspace=None,
                labels={},
                ttl=None,
                idle_timeout=None,
                allow_dangerous_workspace=False,
            )
            fork.id = str(row["id"])
            fork.warnings = tuple(row.get("warnings", ()))
            forks.append(fork)
        return forks

    async def pause(self) -> None:
        """Stop every process of the box where it stands; :meth:`resume` goes on."""
        await self.remote.call("POST", f"{self.path}/pause")

    async def resume(self) -> None:
        await self.remote.call("POST", f"{self.path}/resume")

    async def stats(self) -> dict[str, Any]:
        """Resource use of the whole box (memory, CPU seconds, pids, OOM kills)."""
        stats: dict[str, Any] = (await self.describe()).get("stats") or {}
        return stats

    async def oom_kills(self) -> int:
        """Processes the box's memory limit killed so far."""
        return int((await self.stats()).get("oom_kills", 0))

    async def describe(self) -> dict[str, Any]:
        """The server's view of the box: state, labels, TTL, limits, live stats."""
        data: dict[str, Any] = await self.remote.json("GET", self.path)
        return data

    async def run(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        check: bool = False,
    ) -> CommandResult:
        body = _run_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        result = _result(await self.remote.json("POST", f"{self.path}/run", json=body))
        return _checked(result, cmd, check)

    async def spawn(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | Literal["pipe"] | None = None,
    ) -> RemoteProcess:
        body: dict[str, Any] = {"cmd": cmd, "cwd": cwd, "env": env, "background": True}
        if stdin == "pipe":
            body["stdin_pipe"] = True
        else:
            body["stdin"] = stdin
        info = await self.remote.json("POST", f"{self.path}/run", json=body)
        return RemoteProcess(self, int(info["pid"]), str(info["command"]))

    async def processes(self) -> list[ProcessInfo]:
        rows = await self.remote.json("GET", f"{self.path}/processes")
        return [ProcessInfo(**row) for row in rows]

    async def process(self, pid: int) -> RemoteProcess:
        info = await self.remote.json("GET", f"{self.path}/processes/{pid}")
        return RemoteProcess(self, pid, str(info["command"]))

    def exec_stream(
        self,
        cmd: Command,
        *,
        stdin: Literal["pipe"] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> RemoteExecStream:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        params: list[tuple[str, str | int | float | bool | None]] = [("cmd", a) for a in argv]
        params += [("env", f"{k}={v}") for k, v in (env or {}).items()]
        if cwd is not None:
            params.append(("cwd", cwd))
        if timeout is not None:
            params.append(("timeout", str(timeout)))
        return RemoteExecStream(self, params, stdin=stdin == "pipe")

    async def shell(
        self,
        shell: str = "/bin/sh",
        *,
        env: dict[str, str] | None = None,
        cols: int = 80,
        rows: int = 24,
        cwd: str | None = None,
    ) -> RemoteSession:
        body = {"shell": shell, "env": env, "cols": cols, "rows": rows, "cwd": cwd}
        data = await self.remote.json("POST", f"{self.path}/sessions", json=body)
        return RemoteSession(self, str(data["id"]))


class RemoteProcess:
    """A background process in a remote box."""

    def __init__(self, sandbox: RemoteSandbox, pid: int, command: str) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self.command = command

    @property
    def _path(self) -> str:
        return f"{self.sandbox.path}/processes/{self.pid}"

    async def info(self) -> ProcessInfo:
        return ProcessInfo(**await self.sandbox.remote.json("GET", self._path))

    async def wait(self, timeout: float | None = None) -> WaitResult:
        params = {} if timeout is None else {"timeout": timeout}
        http_timeout = None if timeout is None else timeout + 30
        data = await self.sandbox.remote.json(
            "POST", f"{self._path}/wait", params=params, timeout=http_timeout
        )
        return WaitResult(**data)

    async def output_bytes(self, stream: Literal["stdout", "stderr"] = "stdout") -> bytes:
        response = await self.sandbox.remote.call(
            "GET", f"{self._path}/output", params={"stream": stream}
        )
        return response.content

    async def output(self, stream: Literal["stdout", "stderr"] = "stdout") -> str:
        return (await self.output_bytes(stream)).decode("utf-8", "replace")

    async def signal(self, sig: str | int = "SIGTERM", *, group: bool = True) -> bool:
        body = {"signal": sig, "group": group}
        data = await self.sandbox.remote.json("POST", f"{self._path}/signal", json=body)
        return bool(data["delivered"])

    async def kill(self) -> bool:
        return await self.signal("SIGKILL")

    async def write(self, data: bytes | str, *, eof: bool = False) -> None:
        raw = text_bytes(data)
        params = {"eof": "true"} if eof else {}
        await self.sandbox.remote.call(
            "POST",
            f"{self._path}/stdin",
            content=raw,
            params=params,
            headers={"content-type": "application/octet-stream"},
        )

    async def close_stdin(self) -> None:
        await self.write(b"", eof=True)

    async def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = await self.sandbox.remote.json("GET", f"{self._path}/stats")
        return data


WS_STDIN_CHUNK = 1 << 20
"""Bytes of stdin per WebSocket message (``RemoteExecStream.write``)."""


class RemoteExecStream:
    """A command's events from a server, with the library's stream API (``ExecStream``):
    ``async for event in sb.exec_stream(...)`` (leaving the loop early ends the command),
    ``stream = await sb.exec_stream(...)``, ``async with sb.exec_stream(...) as stream``
    (the command ended on exit if still running), ``wait``, ``signal``, ``kill``, and with
    ``stdin="pipe"`` ``write`` and ``close_stdin``.

    Over a WebSocket (``/exec/ws``): the command's stdin stays open while it runs (closed at
    once without ``stdin="pipe"``), signals reach it, and the socket closing ends it (the
    server's TERM, grace, KILL). The server's frames become the library's events; the end
    is remembered (``exit_code``, ``timed_out``); errors are the library's classes."""

    def __init__(
        self,
        sandbox: RemoteSandbox,
        params: list[tuple[str, str | int | float | bool | None]],
        *,
        stdin: bool,
    ) -> None:
        self.sandbox = sandbox
        self.params = params
        self.exit_code: int | None = None
        self.timed_out = False
        self._stdin = stdin
        self._ws: Any = None
        self._pending: list[ExecEvent] = []
        self._done = False

    def __repr__(self) -> str:
        argv = [v for k, v in self.params if k == "cmd"]
        return f"<RemoteExecStream {argv!r} exit_code={self.exit_code}>"

    @property
    def stdin(self) -> RemoteExecStream | None:
        """The writer (this stream) when started with ``stdin="pipe"``."""
        return self if self._stdin else None

    async def _open(self) -> RemoteExecStream:
        if self._ws is not None:
            return self
        from websockets.asyncio.client import connect, unix_connect
        from websockets.exceptions import InvalidHandshake, InvalidStatus

        remote = self.sandbox.remote
        path = _with_query(f"{self.sandbox.path}/exec/ws", self.params)
        try:
            if remote.url.startswith("unix:"):
                self._ws = await unix_connect(
                    remote.url[5:], f"ws://localhost{path}", max_size=None
                )
            else:
                base = remote.url.rstrip("/").replace("http://", "ws://", 1)
                auth = remote.http.headers.get("authorization")
                headers = {"Authorization": auth} if auth else {}
                self._ws = await connect(base + path, additional_headers=headers, max_size=None)
        except InvalidStatus as exc:  # refused at the handshake: the server said why
            _raise_for(httpx.Response(exc.response.status_code, content=bytes(exc.response.body)))
            raise errors.ServerError(f"the server refused the WebSocket: {exc}") from None
        except (OSError, InvalidHandshake) as exc:
            raise errors.ServerUnavailable(
                f"corral serve at {remote.url} did not open a WebSocket ({exc}); is it running?"
            ) from None
        if not self._stdin:
            from websockets.exceptions import ConnectionClosed

            # A command that ended at once has its frames sent and the socket closed by now:
            # its events are still there to read.
            with contextlib.suppress(ConnectionClosed):
                await self._ws.send(json.dumps({"eof": True}))
        return self

    def __await__(self) -> Generator[Any, None, RemoteExecStream]:
        return self._open().__await__()

    # -- stdin and signals -----------------------------------------------------------------
    async def write(self, data: bytes | str) -> None:
        """Send ``data`` to the command's stdin, in messages the server takes (its
        WebSocket messages are capped at 16 MiB): any size arrives whole."""
        if not self._stdin:
            raise errors.SandboxError(
                "this stream has no stdin; start it with stdin='pipe'",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        await self._open()
        view = memoryview(text_bytes(data))
        for start in range(0, len(view), WS_STDIN_CHUNK):
            await self._send(bytes(view[start : start + WS_STDIN_CHUNK]))

    async def close_stdin(self) -> None:
        if self._stdin:
            await self._open()
            self._stdin = False
            await self._send(json.dumps({"eof": True}))

    async def signal(self, sig: str | int = "SIGTERM") -> bool:
        from corral.processes import parse_signal

        parse_signal(sig)  # an unknown signal is refused here, as the library does
        if self._done:
            return False
        await self._open()
        await self._send(json.dumps({"signal": sig}))
        return True

    async def kill(self) -> bool:
        return await self.signal("SIGKILL")

    async def _send(self, message: bytes | str) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(message)
        except ConnectionClosed as exc:
            raise errors.ServerUnavailable(
                f"the server closed the stream's WebSocket ({exc}); the command has ended"
            ) from None

    # -- events ----------------------------------------------------------------------------
    def _event(self, kind: int, data: bytes) -> ExecEvent | None:
        if kind == frames.STDOUT:
            return Stdout(data)
        if kind == frames.STDERR:
            return Stderr(data)
        if kind == frames.END:
            end = json.loads(data)
            if "error" in end and end.get("ended") == "not_started":
                err = end["error"]
                raise errors.from_code(err["code"], err["message"])
            self.exit_code = int(end["exit_code"])
            self.timed_out = bool(end.get("timed_out"))
            return Exited(self.exit_code)
        if kind == frames.ERROR:
            err = json.loads(data)["error"]
            raise errors.from_code(err["code"], err["message"])
        return None

    async def __anext__(self) -> ExecEvent:
        """The next event. Cancelling it is safe (a ``wait`` with a timeout does): the
        WebSocket keeps the messages not read yet."""
        from websockets.exceptions import ConnectionClosed

        await self._open()
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                message = await self._ws.recv()
            except ConnectionClosed:
                self._done = True
                raise errors.ServerUnavailable(
                    "the server's stream ended before the command did"
                ) from None
            if not isinstance(message, bytes):
                continue
            try:
                for kind, data in frames.split_frames(bytearray(message)):
                    event = self._event(kind, data)
                    if event is not None:
                        self._pending.append(event)
            except BaseException:
                await self._close()
                raise
        event = self._pending.pop(0)
        if isinstance(event, Exited):
            await self._close()
        return event

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecEvent]:
        """The events; leaving the loop early (``break``, an exception) ends the command,
        as the library's stream does."""
        try:
            while True:
                try:
                    event = await self.__anext__()
                except StopAsyncIteration:
                    return
                yield event
        finally:
            await self._close()

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; the status. Events not read are dropped. Past ``timeout``,
        :class:`corral.Timeout` and the command goes on."""
        try:
            async with asyncio.timeout(timeout):
                while not self._done:
                    with contextlib.suppress(StopAsyncIteration):
                        await self.__anext__()
        except TimeoutError:
            raise errors.Timeout(f"the command is still running after {timeout:g} s") from None
        if self.exit_code is None:
            raise errors.ServerUnavailable("the server's stream ended before the command did")
        return self.exit_code

    async def _close(self) -> None:
        """Close the socket: if the command still runs, the server ends it (TERM, grace,
        KILL)."""
        self._done = True
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()

    async def __aenter__(self) -> RemoteExecStream:
        return await self._open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()


RemotePipedStream = RemoteExecStream
"""The name it had when only ``stdin="pipe"`` went over a WebSocket."""


class RemoteFiles:
    """A remote box's files; contents travel as byte streams."""

    def __init__(self, sandbox: RemoteSandbox) -> None:
        self.sandbox = sandbox

    def _path(self, what: str = "") -> str:
        return f"{self.sandbox.path}/files{what}"

    async def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path, "offset": offset}
        if length is not None:
            params["length"] = length
        response = await self.sandbox.remote.call("GET", self._path("/content"), params=params)
        return response.content

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode("utf-8", "replace")

    async def write(self, path: str, data: bytes | str, *, append: bool = False) -> int:
        raw = text_bytes(data)
        params = {"path": path, "append": "true" if append else "false"}
        out = await self.sandbox.remote.json(
            "PUT",
            self._path("/content"),
            params=params,
            content=raw,
            headers={"content-type": "application/octet-stream"},
        )
        return int(out["size"])  # the file's new size, as Sandbox.files.write answers

    async def list(self, path: str = ".") -> list[FileInfo]:
        rows = await self.sandbox.remote.json("GET", self._path(), params={"path": path})
        return [FileInfo(**row) for row in rows]

    async def stat(self, path: str) -> FileInfo | None:
        try:
            row = await self.sandbox.remote.json("GET", self._path("/stat"), params={"path": path})
        except errors.FileNotFound:
            return None
        return FileInfo(**row)

    async def exists(self, path: str) -> bool:
        return await self.stat(path) is not None

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        params = {"path": path, "parents": "true" if parents else "false"}
        await self.sandbox.remote.call("POST", self._path("/mkdir"), params=params)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self.sandbox.remote.call("DELETE", self._path(), params=params)


class RemoteSession:
    """A terminal (PTY) session in a remote box, driven as an agent drives one."""

    def __init__(self, sandbox: RemoteSandbox, session_id: str) -> None:
        self.sandbox = sandbox
        self.session_id = session_id

    @property
    def _path(self) -> str:
        return f"{self.sandbox.path}/sessions/{self.session_id}"

    async def write(self, data: str) -> None:
        await self.sandbox.remote.call("POST", f"{self._path}/write", json={"data": data})

    async def expect(self, pattern: str, timeout: float | None = 30.0) -> dict[str, Any]:
        http_timeout = None if timeout is None else timeout + 30
        data: dict[str, Any] = await self.sandbox.remote.json(
            "POST",
            f"{self._path}/expect",
            json={"pattern": pattern, "timeout": timeout},
            timeout=http_timeout,
        )
        return data

    async def read(self) -> str:
        data = await self.sandbox.remote.json("GET", f"{self._path}/output")
        return str(data["output"])

    async def close(self) -> int | None:
        data = await self.sandbox.remote.json("DELETE", self._path)
        code = data.get("exit_code")
        return None if code is None else int(code)


def _absolute(path: str | os.PathLike[str]) -> str:
    """``path`` against this process's directory (the server has its own)."""
    return os.path.join(os.getcwd(), os.fspath(path))
