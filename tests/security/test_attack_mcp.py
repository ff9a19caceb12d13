"""Issue 13 classes 5 and 8 (MCP) and issue 14's MCP fragility, through the real ``mcp``
client over stdio and HTTP on 127.0.0.1, with real boxes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from corral.errors import PolicyError
from corral.server.transport import http_server_config
from corral.tools import SecretStore
from corral.tools.mcp import ServerConfig, build_http_app

pytestmark = pytest.mark.needs_bwrap


def stdio(*extra: str) -> Client:
    return Client(
        StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp", *extra])
    )


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert result.structured_content is not None, result
    data: dict[str, Any] = result.structured_content
    assert result.is_error == ("error" in data)
    return data


# ---- class 5: a token on loopback too --------------------------------------------------------
def test_http_app_refuses_to_exist_without_a_token_on_loopback() -> None:
    with pytest.raises(PolicyError, match="token"):
        build_http_app(ServerConfig(secrets=SecretStore()), host="127.0.0.1")
    with pytest.raises(PolicyError):  # the opt-out is for loopback only
        build_http_app(ServerConfig(secrets=SecretStore()), host="0.0.0.0", insecure_no_token=True)
    build_http_app(ServerConfig(secrets=SecretStore()), insecure_no_token=True)


@pytest.fixture
def cli_server(tmp_path: Path) -> Any:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("CORRAL_MCP_TOKEN", None)
    (tmp_path / "run").mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "mcp", "--http", "127.0.0.1:0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the socket listens
        yield line
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if proc.stderr is not None:
            proc.stderr.close()


async def test_cli_generates_a_private_token_and_says_where(cli_server: str) -> None:
    line = cli_server
    found = re.search(r"serving streamable HTTP on (http://\S+/mcp); token in (\S+)", line)
    assert found, line
    assert "permission mode default" in line and "network none" in line
    url, token_file = found.group(1), Path(found.group(2))
    info = token_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    token = token_file.read_text().strip()
    async with httpx2.AsyncClient() as http:
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        assert (await http.post(url, json=ping)).status_code == 401
        wrong = {"Authorization": "Bearer " + token[:-1] + ("A" if token[-1] != "A" else "B")}
        assert (await http.post(url, json=ping, headers=wrong)).status_code == 401
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        asyncio.timeout(60),
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        ran = await call(client, "run_command", {"command": "echo in-box"})
        assert ran["stdout"] == "in-box\n"


def test_stdio_server_prints_one_line_on_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "corral", "mcp", "--permission-mode", "read-only"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == ""  # the protocol channel stays clean
    lines = done.stderr.splitlines()
    assert lines and lines[0].startswith("corral mcp: serving on stdio;"), done.stderr
    assert "permission mode read-only" in lines[0]


# ---- class 8: idle connections do not starve a client ----------------------------------------
@pytest.fixture
async def token_server() -> AsyncIterator[str]:
    app = build_http_app(ServerConfig(secrets=SecretStore()), token="t0ken")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    config = http_server_config(app, header_timeout=1.0, max_connections=64)
    config.lifespan = "on"
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        server.should_exit = True
        async with asyncio.timeout(20):
            await task
        sock.close()


async def test_a_thousand_idle_connections_do_not_starve_a_client(token_server: str) -> None:
    port = int(token_server.rsplit(":", 1)[1].split("/")[0])
    # Both ends of 1100 connections are this process's: over an ordinary user's usual soft
    # limit of 1024 open files (root's here is higher).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    idle: list[asyncio.StreamWriter] = []
    try:
        for n in range(1100):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            if n % 2:  # half send a request head that never ends (slowloris)
                writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            idle.append(writer)
        headers = {"Authorization": "Bearer t0ken"}
        async with (
            asyncio.timeout(15),
            create_mcp_http_client(headers=headers) as http,
            Client(streamable_http_client(token_server, http_client=http)) as client,
        ):
            assert len((await client.list_tools()).tools) == 18
    finally:
        for writer in idle:
            writer.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_request_head_that_never_ends_is_closed(token_server: str) -> None:
    port = int(token_server.rsplit(":", 1)[1].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    async with asyncio.timeout(10):  # header_timeout is 1 s
        assert await reader.read() == b""
    writer.close()


# ---- issue 14: fragility ----------------------------------------------------------------------
async def test_non_utf8_filename_is_escaped_and_the_server_lives(tmp_path: Path) -> None:
    raw = b"bad-\xff\xfe-name"
    (tmp_path / os.fsdecode(raw)).write_bytes(b"x")
    (tmp_path / "good").write_text("y")
    async with asyncio.timeout(60), stdio("--workspace", str(tmp_path)) as client:
        listed = await call(client, "vfs_list", {"path": "."})
        rows = {e["name"]: e for e in listed["entries"]}
        assert "good" in rows and "name_escaped" not in rows["good"]
        bad = rows["bad-\\xff\\xfe-name"]
        assert bad["name_escaped"] is True and base64.b64decode(bad["name_base64"]) == raw
        # The server is alive and answers the next call.
        assert (await call(client, "run_command", {"command": "echo alive"}))["stdout"] == "alive\n"


async def test_a_box_that_fails_to_start_returns_the_error_object(tmp_path: Path) -> None:
    # A workspace that is not there is refused when the server starts: this one goes after.
    gone = tmp_path / "workspace-removed-after-start"
    gone.mkdir()
    async with asyncio.timeout(60), stdio("--workspace", str(gone)) as client:
        gone.rmdir()
        result = await call(client, "run_command", {"command": "true"})
        assert set(result["error"]) >= {"code", "message"}, result
        assert "internal server error" not in json.dumps(result).lower()


async def test_approval_without_elicitation_is_terminal_not_retry_forever() -> None:
    async with asyncio.timeout(60), stdio("--capabilities", "run_command") as client:
        for _ in range(2):  # the retry the model is told not to make fails the same way
            result = await call(client, "run_command", {"command": "git push origin main"})
            error = result["error"]
            assert error["code"] == "approval_unavailable" and error["retryable"] is False
            assert "do not retry" in error["message"] and "human" in error["message"]
            assert result["approval"]["command"] == "git push origin main"


# ---- class 5: a unix socket for its owner only -----------------------------------------------
@pytest.fixture
def unix_server() -> Any:
    # Not under tmp_path: pytest's base dir is 0700, and the test lets another uid try.
    where = Path(tempfile.mkdtemp(prefix="corral-uds-", dir="/tmp"))
    path = where / "mcp.sock"
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_MCP_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "mcp", "--unix", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the socket listens
        assert f"unix:{path}" in line, line
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if proc.stderr is not None:
            proc.stderr.close()
        shutil.rmtree(where, ignore_errors=True)


async def test_unix_socket_serves_its_owner_only(unix_server: Path) -> None:
    path = unix_server
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    transport = httpx2.AsyncHTTPTransport(uds=str(path))
    async with (
        asyncio.timeout(60),
        httpx2.AsyncClient(transport=transport) as http,
        Client(streamable_http_client("http://localhost:1/mcp", http_client=http)) as client,
    ):
        assert (await call(client, "run_command", {"command": "echo uds"}))["stdout"] == "uds\n"
    if os.getuid() != 0:
        return
    # Another uid, even with the mode opened up, is cut off by the peer check.
    os.chmod(path, 0o666)
    os.chmod(path.parent, 0o755)
    probe = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect(sys.argv[1])\n"
        "s.sendall(b'GET /mcp HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n')\n"
        "print(repr(s.recv(100)))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        probe,
        str(path),
        user=65534,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    stdout, stderr = out.decode(), err.decode()
    assert "HTTP/1.1" not in stdout, stdout
    # The server closes at once: the probe sees EOF, a reset, or a broken pipe on its send,
    # depending on which side of the close its sendall lands.
    cut_off = ("ConnectionResetError" in stderr) or ("BrokenPipeError" in stderr)
    assert stdout.strip() == "b''" or cut_off, (stdout, stderr)
