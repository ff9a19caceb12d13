"""The MCP server through the official SDK client: stdio (a real subprocess) and HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from mcp.client.context import ClientRequestContext
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from corral.tools import SecretStore
from corral.tools.mcp import HttpApp, ServerConfig, build_http_app

pytestmark = pytest.mark.needs_bwrap

CARGO_HOME = Path.home() / ".cargo"
CRATE_MAIN = (
    'fn answer() -> String {\n    42u32\n}\n\nfn main() {\n    println!("{}", answer());\n}\n'
)
PROMPT_SCRIPT = (
    "printf 'Do you want to perform these actions?\\n  Enter a value: '\n"
    'read a\necho "Apply complete! ($a)"\n'
)


def stdio_params(*extra: str, env: dict[str, str] | None = None) -> StdioServerParameters:
    # The SDK passes the server only a few variables: PYTHONPATH picks the corral under test.
    path = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "corral", "mcp", *extra],
        env={**get_default_environment(), **path, **(env or {})},
    )


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert result.structured_content is not None
    assert json.loads(result.content[0].text) == result.structured_content  # type: ignore[union-attr]
    data: dict[str, Any] = result.structured_content
    assert result.is_error == ("error" in data)
    return data


@pytest.fixture
def crate(tmp_path: Path) -> Path:
    ws = tmp_path / "crate"
    (ws / "src").mkdir(parents=True)
    (ws / "Cargo.toml").write_text(
        '[package]\nname = "myproject"\nversion = "0.1.0"\nedition = "2021"\n', encoding="utf-8"
    )
    (ws / "src" / "main.rs").write_text(CRATE_MAIN, encoding="utf-8")
    return ws


async def test_stdio_replays_the_five_scenarios(crate: Path) -> None:
    if not (CARGO_HOME / "bin" / "cargo").exists():
        pytest.skip("cargo is not installed under ~/.cargo")
    async with (
        asyncio.timeout(120),
        Client(stdio_params("--preset", "rust", "--workspace", str(crate))) as client,
    ):
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert (
            listed["vfs_read"].annotations is not None
            and listed["vfs_read"].annotations.read_only_hint
        )
        assert (
            listed["run_command"].annotations is not None
            and listed["run_command"].annotations.destructive_hint
        )

        # 1: oneshot compile with diagnostics as JSON
        checked = await call(
            client,
            "run_command",
            {
                "command": "cargo",
                "args": ["check", "--message-format=json"],
                "wait": True,
                "timeout_secs": 60,
            },
        )
        assert checked["exit_code"] == 101 and checked["timed_out"] is False
        messages = [json.loads(line) for line in checked["stdout"].splitlines()]
        rendered = [
            m["message"]["rendered"] for m in messages if m.get("reason") == "compiler-message"
        ]
        assert any(
            "error[E0308]: mismatched types" in r and "src/main.rs:2:5" in r for r in rendered
        )
        assert "could not compile `myproject`" in checked["stderr"]

        # 2: background job polled
        script = "echo building >&2; while [ ! -s go ]; do sleep 0.01; done; echo finished >&2"
        job = await call(client, "run_command", {"command": script, "wait": False})
        assert job["status"] == "running"
        waited = await call(client, "wait_for_process", {"pid": job["pid"], "timeout_ms": 20})
        assert waited["status"] == "timeout"
        partial = await call(client, "read_process_output", {"pid": job["pid"], "stream": "stderr"})
        assert partial["status"] == "running"
        await call(client, "vfs_write", {"path": "go", "content": "now"})
        done = await call(client, "wait_for_process", {"pid": job["pid"], "timeout_ms": 5000})
        assert done == {"pid": job["pid"], "status": "exited", "exit_code": 0}
        final = await call(client, "read_process_output", {"pid": job["pid"], "stream": "stderr"})
        assert final["output"] == "building\nfinished\n"

        # 3: a confirmation prompt found with shell_expect
        await call(client, "vfs_write", {"path": "apply.sh", "content": PROMPT_SCRIPT})
        sid = (await call(client, "open_shell", {"shell": "/bin/sh"}))["session_id"]
        await call(client, "shell_write", {"session_id": sid, "input": "sh apply.sh\n"})
        prompt = await call(
            client,
            "shell_expect",
            {"session_id": sid, "pattern": "Enter a value:", "timeout_secs": 10},
        )
        assert prompt["matched"] and "perform these actions" in prompt["output"]
        await call(client, "shell_write", {"session_id": sid, "input": "yes\n"})
        assert (
            await call(
                client,
                "shell_expect",
                {"session_id": sid, "pattern": r"Apply complete! \(yes\)", "timeout_secs": 10},
            )
        )["matched"]

        # 4: switch/case with respond and captures
        await call(
            client,
            "shell_write",
            {"session_id": sid, "input": "echo tool version 2.7; read v; echo answer=$v\n"},
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
        case = await call(
            client, "shell_expect_cases", {"session_id": sid, "cases": cases, "timeout_secs": 10}
        )
        assert (case["matched_case"], case["tag"], case["captures"]) == (
            1,
            "ok",
            ["version 2.7", "2.7"],
        )
        assert (
            await call(
                client,
                "shell_expect",
                {"session_id": sid, "pattern": "answer=Detected version 2.7", "timeout_secs": 10},
            )
        )["matched"]

        # 5: a scripted flow in one call
        steps = [
            {"type": "send", "input": "ls src\n"},
            {"type": "expect", "pattern": r"main\.rs", "timeout_secs": 10},
            {"type": "send", "input": "echo status=$?\n"},
            {"type": "expect", "pattern": r"status=0"},
        ]
        batch = await call(
            client, "shell_batch", {"session_id": sid, "steps": steps, "timeout_secs": 10}
        )
        assert (batch["completed"], batch["total"]) == (4, 4)


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # 2026 InputRequired round / 2025 request
async def test_stdio_asks_the_human_through_elicitation(mode: Any) -> None:
    asked: list[str] = []

    async def elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(
            action="accept", content={"approve": "git push" in params.message}
        )

    async with (
        asyncio.timeout(30),
        Client(stdio_params(), elicitation_callback=elicit, mode=mode) as client,
    ):
        approved = await call(client, "run_command", {"command": "echo git push"})
        assert approved["stdout"] == "git push\n"
        declined = await call(client, "run_command", {"command": "rm -rf /tmp/nothing"})
        assert declined["error"]["code"] == "approval_denied"
    assert len(asked) == 2


@pytest.mark.parametrize("mode", ["auto", "legacy"])
@pytest.mark.parametrize("approve", ["false", "no", "true", 1, None])
async def test_only_a_boolean_true_answer_approves(mode: Any, approve: Any) -> None:
    """A form-based client may send its fields as strings: ``"false"`` is not a yes."""

    async def elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"approve": approve})

    async with (
        asyncio.timeout(30),
        Client(stdio_params(), elicitation_callback=elicit, mode=mode) as client,
    ):
        await call(client, "run_command", {"command": "mkdir -p build"})
        refused = await call(client, "run_command", {"command": "rm -rf build && echo DELETED"})
        assert refused["error"]["code"] == "approval_denied", refused
        left = await call(client, "run_command", {"command": "test -d build"})
        assert left["exit_code"] == 0


async def test_stdio_without_elicitation_returns_approval_unavailable() -> None:
    async with asyncio.timeout(30), Client(stdio_params("--capabilities", "run_command")) as client:
        assert [t.name for t in (await client.list_tools()).tools] == ["run_command"]
        result = await call(client, "run_command", {"command": "git push origin main"})
        assert result["error"]["code"] == "approval_unavailable"
        assert result["approval"]["command"] == "git push origin main"


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # connections queue here until uvicorn accepts: no readiness race
    return sock


@pytest.fixture
async def http_server() -> AsyncIterator[tuple[str, HttpApp]]:
    config = ServerConfig(secrets=SecretStore({"db-password": "pa55w0rd-xyz"}))
    app = build_http_app(config, token="t0ken")
    sock = _listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", app
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()


async def test_http_session_gets_a_sandbox_closed_at_session_end(
    http_server: tuple[str, HttpApp],
) -> None:
    url, app = http_server
    headers = {"Authorization": "Bearer t0ken"}
    async with asyncio.timeout(30), create_mcp_http_client(headers=headers) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            assert len(app.sessions) == 0  # lazily: listing tools starts nothing
            listed = (await client.list_tools()).tools
            assert len(listed) == 18
            # Every tool publishes its result's schema; the client checks results against it.
            assert all(t.output_schema and t.output_schema["type"] == "object" for t in listed)
            ran = await call(
                client,
                "sandbox.exec",
                {
                    "runtime": "python3",
                    "code": "import os; print(os.environ['P'])",
                    "secrets": {"P": "{{secret:db-password}}"},
                },
            )
            assert ran["stdout"] == "[REDACTED:db-password]\n"
            job = await call(client, "run_command", {"command": "echo bg", "wait": False})
            assert (
                await call(client, "wait_for_process", {"pid": job["pid"], "timeout_ms": 5000})
            )["exit_code"] == 0
            # How the command ended and the timeout in effect, checked against the schema.
            [run] = [t for t in listed if t.name == "run_command"]
            assert {"ended", "timeout_secs"} <= set(run.output_schema["properties"])  # type: ignore[index]
            done = await call(client, "run_command", {"command": "exit 3", "timeout_secs": 9})
            assert (done["exit_code"], done["ended"], done["timeout_secs"]) == (3, "exited", 9)
            assert len(app.sessions) == 1
        assert len(app.sessions) == 0


async def test_http_session_left_idle_has_its_sandbox_closed_on_time() -> None:
    """A client that goes silent without deleting its session (it crashed): its sandbox and
    what runs in it are closed once the session has been idle for the timeout, with no
    other session's call needed to notice."""
    app = build_http_app(ServerConfig(secrets=SecretStore(), idle_timeout=1.0), token="t0ken")
    sock = _listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    headers = {"Authorization": "Bearer t0ken"}
    try:
        async with (
            asyncio.timeout(30),
            create_mcp_http_client(headers=headers) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            job = await call(client, "run_command", {"command": "sleep 1000", "wait": False})
            [session] = app.sessions._open.values()
            proc = session.toolbox.sandbox.registry.get(job["pid"])
            await proc.wait()  # the client is silent: this ends when the sandbox is closed
            assert len(app.sessions) == 0
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()


async def test_http_refuses_requests_without_the_bearer_token(
    http_server: tuple[str, HttpApp],
) -> None:
    url, _ = http_server
    async with httpx2.AsyncClient() as http:
        response = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert response.status_code == 401


def test_http_off_loopback_requires_a_token() -> None:
    from corral.errors import PolicyError

    with pytest.raises(PolicyError):
        build_http_app(ServerConfig(secrets=SecretStore()), host="0.0.0.0")


def test_secrets_file_named_in_the_policy_feeds_the_store(tmp_path: Path) -> None:
    import argparse

    from corral.cli.mcp import config_from_args

    secrets = tmp_path / "secrets.env"
    secrets.write_text("API_KEY=from-policy-file\n")
    policy = tmp_path / "corral.toml"
    policy.write_text(f'secrets_file = "{secrets}"\n')
    parser = argparse.ArgumentParser()
    from corral.cli.mcp import register

    register(parser.add_subparsers())
    args = parser.parse_args(["mcp", "--policy", str(policy)])
    config = config_from_args(args)
    assert config.secrets.resolve_value("{{secret:API_KEY}}") == "from-policy-file"


async def test_stdio_publishes_a_box_port_and_takes_network_options(tmp_path: Path) -> None:
    """``corral mcp -p 0:8000``: a server the agent starts in the box is reached from the
    host at the address ``sandbox_info`` names; ``--network``/``--allow-host`` apply too."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "index.html").write_text("hello from the box\n")
    args = ("--workspace", str(ws), "-p", "0:8000", "--network", "allowlist")
    async with (
        asyncio.timeout(120),
        Client(stdio_params(*args, "--allow-host", "pypi.org")) as client,
    ):
        info = await call(client, "sandbox_info", {})
        (where,) = info["published"]
        host, port = where.split("->")[0].rsplit(":", 1)
        assert host == "127.0.0.1"
        started = await call(
            client,
            "run_command",
            {"command": "python3", "args": ["-u", "-m", "http.server", "8000"], "wait": False},
        )
        pid = started["pid"]
        while (
            "Serving HTTP"
            not in (await call(client, "read_process_output", {"pid": pid}))["output"]
        ):  # bounded by the timeout above; each wait returns after 100 ms or the exit
            assert (await call(client, "wait_for_process", {"pid": pid, "timeout_ms": 100}))[
                "status"
            ] == "timeout"
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{host}:{port}/index.html", timeout=30).read()
        )
        assert body == b"hello from the box\n"
        proxy = await call(
            client, "run_command", {"command": "sh", "args": ["-c", "echo $HTTPS_PROXY"]}
        )
        assert proxy["stdout"].startswith("http://"), proxy  # allowlist mode: the proxy is set


def test_mcp_network_options_are_checked_before_serving(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "corral", "mcp", "--network", "none", "--allow-host", "x.org"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode != 0 and "contradicts" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _mcp(*args: str) -> Any:
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "corral", "mcp", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--capabilities", "run_command,vfs_reed"], "unknown capability vfs_reed: use tool names"),
        (["--workspace", "/nonexistent"], "workspace /nonexistent is not a directory"),
        (["--http", "127.0.0.1:99999"], "cannot listen on 127.0.0.1:99999: a port is 0 to 65535"),
        (["--http", "192.0.2.1:80"], "cannot listen on 192.0.2.1:80: Cannot assign requested"),
    ],
)
def test_bad_mcp_options_are_one_line_before_serving(args: list[str], says: str) -> None:
    r = _mcp(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"corral: {r.stderr.removeprefix('corral: ')}" and says in r.stderr
    assert r.stderr.count("\n") == 1 and "serving" not in r.stderr


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = _mcp("--http", f"127.0.0.1:{taken.getsockname()[1]}")
    assert r.returncode == 2 and "Address already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_toolbox_refuses_an_unknown_capability() -> None:
    from corral.errors import SandboxError
    from corral.tools.toolbox import checked_capabilities

    with pytest.raises(SandboxError, match="unknown capabilities a, b: "):
        checked_capabilities({"run_command", "b", "a"})
    assert checked_capabilities({"*", "tool.invoke:vfs_read", "sandbox.exec"}) is not None


def test_ctrl_c_ends_the_stdio_server_while_its_client_holds_stdin(tmp_path: Path) -> None:
    import signal
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "mcp"],
        stdin=subprocess.PIPE,  # held open, as a client holds it
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    assert b"serving on stdio" in proc.stderr.readline()  # its signal handler is in place
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=20) == 130  # it waited for stdin to close before
    finally:
        proc.kill()
        proc.communicate()


def test_the_http_token_file_goes_with_the_server() -> None:
    import re
    import signal
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "mcp", "--http", "127.0.0.1:0"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        found = re.search(r"token in (\S+) ", line)
        assert found, line
        token_file = Path(found.group(1))
        assert token_file.is_file()  # a port-0 address is never used again: nothing reuses it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not token_file.exists()
    finally:
        proc.kill()
        proc.communicate()


class RawStdio:
    """``corral mcp`` on stdio driven by hand (newline-delimited JSON-RPC): what a client
    that dies, or sends bytes the SDK client never would, does to the server."""

    def __init__(self, *args: str) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corral", "mcp", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.pending = b""
        self.ids = 0

    def send_line(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def send(self, message: dict[str, Any]) -> None:
        self.send_line(json.dumps(message).encode())

    def recv(self, timeout: float = 60) -> dict[str, Any]:
        import select
        import time

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            assert ready, f"no answer within {timeout} s"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            assert chunk, "the server closed stdout"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        self.send({"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params})
        answer = self.recv()
        assert answer.get("id") == self.ids, answer
        return answer

    def initialize(self, capabilities: dict[str, Any] | None = None) -> None:
        hello = {
            "protocolVersion": "2025-11-25",
            "capabilities": capabilities or {},
            "clientInfo": {"name": "raw", "version": "1"},
        }
        assert "result" in self.request("initialize", hello)
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def finish(self) -> tuple[int, str]:
        """Close stdin (if still open) and return the exit status and stderr."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
        return rc, self.proc.stderr.read().decode()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def test_a_client_that_dies_with_a_call_in_flight_leaves_nothing_behind() -> None:
    """A killed client closes both pipes while its server still has a call to answer: the
    answer is dropped, the server exits 0 without a traceback, and its sandbox is closed
    (temp workspace, mount, cgroups, state) as on a normal end of stdin."""
    raw = RawStdio()
    try:
        raw.initialize()
        info = raw.request("tools/call", {"name": "sandbox_info", "arguments": {}})
        box = info["result"]["structuredContent"]
        workspace, box_id = Path(box["workspace"]), box["sandbox_id"]
        os.mkfifo(workspace / "ready", 0o666)
        command = {"command": "echo > ready; sleep 100"}
        raw.send(
            {
                "jsonrpc": "2.0",
                "id": 99,
                "method": "tools/call",
                "params": {"name": "run_command", "arguments": command},
            }
        )
        with open(workspace / "ready", "rb") as ready:  # opens once the box writes to it
            ready.read()
        assert raw.proc.stdin is not None and raw.proc.stdout is not None
        raw.proc.stdin.close()
        raw.proc.stdout.close()  # as a killed client's pipes close
        rc, stderr = raw.finish()
    finally:
        raw.close()
    assert rc == 0 and "Traceback" not in stderr, stderr
    assert not workspace.exists()
    assert box_id not in Path("/proc/self/mountinfo").read_text()
    assert not list(Path("/sys/fs/cgroup").glob(f"**/corral/{box_id}"))


def test_stdio_answers_a_line_it_cannot_read() -> None:
    """A lone surrogate escape (what json.dumps writes for a non-UTF-8 file name), a cut
    line or a request of the wrong shape is answered at once, as over HTTP; the server then
    goes on serving."""
    raw = RawStdio()
    try:
        raw.initialize()
        head = '"method":"tools/call","params":{"name":"vfs_write","arguments":'
        raw.send_line(b'{"jsonrpc":"2.0","id":50,' + head.encode() + rb'{"path":"caf\udce9"}}}')
        surrogate = raw.recv(30)
        assert (surrogate["id"], surrogate["error"]["code"]) == (None, -32700), surrogate
        raw.send_line(b'{"jsonrpc":"2.0","id":53,"method":"tools/list"')
        assert raw.recv(30)["error"]["code"] == -32700
        raw.send_line(b'{"jsonrpc":"2.0","id":54,"method":5}')
        wrong = raw.recv(30)
        assert (wrong["id"], wrong["error"]["code"]) == (54, -32602), wrong
        assert "tools" in raw.request("tools/list", {})["result"]
        rc, stderr = raw.finish()
        assert rc == 0 and "Traceback" not in stderr, stderr
    finally:
        raw.close()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ({"error": {"code": -32603, "message": "client blew up"}}, "client blew up"),
        ({"result": {"action": "maybe"}}, "not understood"),
    ],
)
def test_an_elicitation_that_fails_is_a_tool_error(answer: dict[str, Any], says: str) -> None:
    """A client that answers the approval question with an error, or an answer of no known
    shape: the tool call gets a structured result (isError, a code), not a protocol error."""
    raw = RawStdio()
    try:
        raw.initialize({"elicitation": {}})
        params = {"name": "run_command", "arguments": {"command": "git push"}}
        raw.send({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params})
        asked = raw.recv(30)
        assert asked["method"] == "elicitation/create", asked
        raw.send({"jsonrpc": "2.0", "id": asked["id"], **answer})
        done = raw.recv(30)
        assert done["id"] == 7 and done["result"]["isError"] is True, done
        error = done["result"]["structuredContent"]["error"]
        assert error["code"] == "approval_unavailable" and says in error["message"], error
        assert "git push" in error["message"]
    finally:
        raw.close()


async def test_an_elicitation_nobody_answers_ends_in_a_tool_error() -> None:
    async def never(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    config = ServerConfig(secrets=SecretStore(), approval_timeout=0.5)
    app = build_http_app(config, token="t0ken")
    sock = _listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    try:
        async with (
            asyncio.timeout(30),
            create_mcp_http_client(headers={"Authorization": "Bearer t0ken"}) as http,
            Client(streamable_http_client(url, http_client=http), elicitation_callback=never) as c,
        ):
            result = await call(c, "run_command", {"command": "git push"})
            assert result["error"]["code"] == "approval_unavailable"
            assert "no answer within 0.5 s" in result["error"]["message"]
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()
