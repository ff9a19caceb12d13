"""Published ports (``-p``, ``network.publish``): a server in a real box, reached from the host
on 127.0.0.1, in every network mode the backend has, and the errors a user can meet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import backend_policy
from corral import Policy, PublishedPort, Sandbox, SyncSandbox
from corral.audit import read_records
from corral.errors import PolicyError, SandboxError
from corral.net import PortInUse
from corral.processes import Process

pytestmark = pytest.mark.needs_bwrap

BACKEND = os.environ.get("CORRAL_TEST_BACKENDS", "bwrap").split(",")[0]
READY_TIMEOUT = 60.0

# An echo server in the box: prints "ready" once it listens, then echoes every connection.
ECHO = """\
import socket, sys, threading
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
def serve(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


async def ready(proc: Process) -> None:
    """Until the box's server printed "ready" (bounded)."""
    queue = proc.subscribe()
    try:
        async with asyncio.timeout(READY_TIMEOUT):
            while "ready" not in proc.output():
                stream, _ = await queue.get()
                assert stream != "exit", proc.output("stderr")
    finally:
        proc.unsubscribe(queue)


def echo(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        got = bytearray()
        while chunk := conn.recv(65536):
            got += chunk
    return bytes(got)


async def start_echo(sb: Sandbox, box_port: int = 8000) -> Process:
    await sb.files.write("echo.py", ECHO)
    proc = await sb.spawn(["python3", "echo.py", str(box_port)])
    await ready(proc)
    return proc


# ---- the spec's forms ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ip", "host", "box"),
    [
        ("8000", "127.0.0.1", 8000, 8000),
        ("8080:8000", "127.0.0.1", 8080, 8000),
        ("127.0.0.1:8080:8000", "127.0.0.1", 8080, 8000),
        ("[::1]:8080:8000", "::1", 8080, 8000),
        ("0.0.0.0:8080:8000/tcp", "0.0.0.0", 8080, 8000),
        ("0:8000", "127.0.0.1", 0, 8000),
    ],
)
def test_publish_forms(text: str, ip: str, host: int, box: int) -> None:
    spec = PublishedPort.parse(text)
    assert (spec.host_ip, spec.port_on_host, spec.box_port) == (ip, host, box)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("80", "privileged"),
        ("443:8000", "privileged"),
        ("8000/udp", "only TCP"),
        ("localhost:8080:8000", "not a port to publish"),
        ("8080:70000", "less than 65536"),
        ("", "not a port to publish"),
    ],
)
def test_bad_publish_specs_are_refused_clearly(text: str, says: str) -> None:
    with pytest.raises(PolicyError, match=says):
        PublishedPort.parse(text)


def test_a_host_port_published_twice_is_refused() -> None:
    with pytest.raises(PolicyError, match="published twice"):
        Policy(network={"publish": ["8080:8000", "8080:9000"]})


# ---- real boxes -----------------------------------------------------------------------------


async def test_a_box_server_is_reached_from_the_host_with_no_network(
    box_policy: Policy, workspace: Path
) -> None:
    """Network mode ``none``: the box has loopback only, yet the host reaches its server;
    bytes arrive exact, both ways, on concurrent connections."""
    policy = box_policy.model_copy(
        update={
            "network": box_policy.network.model_copy(
                update={"publish": (PublishedPort.parse("0:8000"),)}
            )
        }
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        (published,) = sb.published
        assert published.host_ip == "127.0.0.1" and published.port_on_host > 0
        await start_echo(sb)
        blob = os.urandom(3 << 20)
        assert await asyncio.to_thread(echo, published.port_on_host, blob) == blob
        payloads = [os.urandom(100_000 + i) for i in range(8)]
        got = await asyncio.gather(
            *(asyncio.to_thread(echo, published.port_on_host, p) for p in payloads)
        )
        assert got == payloads
        # the box still has no route out
        r = await sb.run(
            "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 3)\""
        )
        assert r.exit_code != 0
    with pytest.raises(ConnectionRefusedError):  # the host port is closed with the box
        socket.create_connection(("127.0.0.1", published.port_on_host), timeout=5).close()


@pytest.mark.parametrize("mode", ["ports", "allowlist", "full"])
async def test_publish_works_in_the_other_network_modes(
    mode: str, tmp_path: Path, workspace: Path
) -> None:
    network: dict[str, object] = {"mode": mode, "publish": ["0:8000"]}
    if mode == "ports":
        network["ports"] = [18999]  # need not be listening
    if mode == "allowlist":
        network["allow_hosts"] = ["example.test"]
    if mode == "full":
        from corral.net.nat import missing_tools

        if missing_tools():
            pytest.skip(f"full mode needs {', '.join(missing_tools())}")
    async with Sandbox(backend_policy(BACKEND, network=network), workspace=workspace) as sb:
        await start_echo(sb)
        port = sb.published[0].port_on_host
        assert await asyncio.to_thread(echo, port, b"hello\n") == b"hello\n"


async def test_a_box_port_nobody_listens_on_closes_the_connection(
    tmp_path: Path, workspace: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    policy = backend_policy(BACKEND, network={"publish": ["0:8000"]}, audit_log=audit)
    async with Sandbox(policy, workspace=workspace) as sb:
        port = sb.published[0].port_on_host
        # no hang: the client's connection ends (EOF or reset) at once
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.to_thread(echo, port, b"anyone?") == b""
        await start_echo(sb)  # and a server started later is reached
        assert await asyncio.to_thread(echo, port, b"now\n") == b"now\n"
    records = [r for r in read_records(audit) if r.get("protocol") == "publish"]
    assert len(records) == 2, records
    assert {(r["port"], r["box_port"]) for r in records} == {(port, 8000)}


async def test_a_host_port_in_use_fails_the_start_clearly(workspace: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        policy = backend_policy(BACKEND, network={"publish": [f"{port}:8000"]})
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}: the host port is in use") as info:
            async with Sandbox(policy, workspace=workspace):
                pass
        assert info.value.code == "invalid_input"


async def test_info_and_the_sandbox_info_tool_name_the_published_ports(workspace: Path) -> None:
    from corral.tools import Toolbox

    policy = backend_policy(BACKEND, network={"publish": ["0:8000"]})
    async with Sandbox(policy, workspace=workspace) as sb:
        where = str(sb.published[0])
        assert where.startswith("127.0.0.1:") and where.endswith("->8000/tcp")
        assert (await sb.info())["published"] == [where]
        result = await Toolbox(sb).call("sandbox_info", {})
        assert result["published"] == [where]


async def test_every_interface_only_when_asked(workspace: Path) -> None:
    policy = backend_policy(BACKEND, network={"publish": ["0.0.0.0:0:8000", "0:9000"]})
    async with Sandbox(policy, workspace=workspace) as sb:
        everywhere, loopback = sb.published
        assert everywhere.host_ip == "0.0.0.0" and loopback.host_ip == "127.0.0.1"
        await start_echo(sb, 8000)
        assert await asyncio.to_thread(echo, everywhere.port_on_host, b"x") == b"x"


async def test_an_ipv6_host_address(workspace: Path) -> None:
    policy = backend_policy(BACKEND, network={"publish": ["[::1]:0:8000"]})
    async with Sandbox(policy, workspace=workspace) as sb:
        await start_echo(sb)
        port = sb.published[0].port_on_host

        def over_ipv6() -> bytes:
            with socket.create_connection(("::1", port), timeout=30) as conn:
                conn.sendall(b"six\n")
                conn.shutdown(socket.SHUT_WR)
                return conn.recv(64)

        assert await asyncio.to_thread(over_ipv6) == b"six\n"


def test_publish_on_a_sync_sandbox(workspace: Path) -> None:
    policy = backend_policy(BACKEND, network={"publish": "0:8000"})
    with SyncSandbox(policy, workspace=workspace) as sb:
        sb.files.write("index.html", "hello from the box\n")
        server = sb.spawn("python3 -u -m http.server 8000 --bind 127.0.0.1")
        deadline = time.monotonic() + READY_TIMEOUT
        while "Serving HTTP" not in server.output() and time.monotonic() < deadline:
            server.wait(timeout=0.2)  # returns at once when it ends; bounded either way
        url = f"http://127.0.0.1:{sb.published[0].port_on_host}/index.html"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.read() == b"hello from the box\n"


# ---- the CLI ------------------------------------------------------------------------------


def _lines(proc: subprocess.Popen[bytes], timeout: float) -> Iterator[tuple[str, str]]:
    """(stream name, line) from a child's stdout and stderr as they come, until timeout."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    buffers = {"stdout": b"", "stderr": b""}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for key, _ in sel.select(deadline - time.monotonic()):
            chunk = os.read(key.fd, 4096)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buffers[key.data] += chunk
            *done, buffers[key.data] = buffers[key.data].split(b"\n")
            for line in done:
                yield key.data, line.decode(errors="replace")
        if not sel.get_map():
            return


def test_corral_run_publish_serves_http_to_the_host(workspace: Path) -> None:
    """The brief's example: ``corral run -p HOST:8000 -- python3 -m http.server 8000``."""
    if backend_policy(BACKEND).backend != "bwrap":
        pytest.skip("the CLI test runs on bwrap")
    (workspace / "index.html").write_text("hello from the box\n")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        host_port = probe.getsockname()[1]  # a free port, released for corral to take
    argv = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(workspace)]
    argv += ["-p", f"{host_port}:8000", "--", "python3", "-u", "-m", "http.server", "8000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = []
        for stream, line in _lines(proc, READY_TIMEOUT):
            seen.append(line)
            if stream == "stdout" and "Serving HTTP" in line:
                break
        else:
            pytest.fail(f"the server did not start: {seen}")
        url = f"http://127.0.0.1:{host_port}/index.html"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.read() == b"hello from the box\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_corral_run_rejects_a_bad_publish(workspace: Path) -> None:
    argv = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(workspace)]
    r = subprocess.run(
        [*argv, "-p", "80", "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "privileged" in r.stderr


def test_sandbox_error_base() -> None:
    assert issubclass(PortInUse, SandboxError)


def test_a_pool_refuses_a_fixed_host_port() -> None:
    from corral import SandboxPool

    with pytest.raises(PolicyError, match="host port 0"):
        SandboxPool(Policy(network={"publish": ["8080:8000"]}))


async def test_clients_waiting_for_the_box_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no agent answering, at most MAX_WAITING host clients wait; more are closed."""
    from corral.net import publish

    monkeypatch.setattr(publish, "MAX_WAITING", 2)
    publisher = publish.PortPublisher(PublishedPort.parse("0:8000"))
    await publisher.listen()
    try:
        port = publisher.host_port
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed at once
        writer.close()
        assert len(publisher._waiting) == 2
        for _, w in held:
            w.close()
    finally:
        await publisher.close()


# ---- expose: publishing after the start -----------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "ports", "allowlist"])
async def test_expose_publishes_a_port_after_the_start(mode: str, workspace: Path) -> None:
    """``Sandbox.expose``: a server started in a running box is reached from the host, then
    ``unexpose`` closes the host port; mode ``none`` with ``exposable=True``."""
    network: dict[str, object] = {"mode": mode}
    if mode == "ports":
        network["ports"] = [18999]
    if mode == "allowlist":
        network["allow_hosts"] = ["example.test"]
    policy = backend_policy(BACKEND, network=network)
    async with Sandbox(policy, workspace=workspace, exposable=mode == "none") as sb:
        assert not sb.published
        await start_echo(sb)
        await start_echo(sb, 8001)
        exposed = await sb.expose(8000)
        assert exposed.box_port == 8000 and exposed.port_on_host > 0
        assert await sb.expose(8000) == exposed  # the same answer again
        other = await sb.expose(8001)
        assert list(sb.published) == [exposed, other]
        blob = os.urandom(1 << 20)
        assert await asyncio.to_thread(echo, exposed.port_on_host, blob) == blob
        assert await asyncio.to_thread(echo, other.port_on_host, b"two\n") == b"two\n"
        assert await sb.unexpose(8000) is True
        assert await sb.unexpose(8000) is False
        assert list(sb.published) == [other]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", exposed.port_on_host), timeout=5).close()
        again = await sb.expose(8000)  # and again, on a new socket
        assert await asyncio.to_thread(echo, again.port_on_host, b"back\n") == b"back\n"
    with pytest.raises(ConnectionRefusedError):  # closed with the box
        socket.create_connection(("127.0.0.1", again.port_on_host), timeout=5).close()


async def test_expose_says_how_when_the_box_has_no_way_in(workspace: Path) -> None:
    async with Sandbox(backend_policy(BACKEND), workspace=workspace) as sb:
        with pytest.raises(SandboxError) as refused:
            await sb.expose(8000)
        assert refused.value.code == "backend_unavailable"
        assert "exposable=True" in refused.value.message
        with pytest.raises(PolicyError):
            await sb.expose(70000)
    with pytest.raises(SandboxError) as closed:
        await sb.expose(8000)
    assert closed.value.code == "sandbox_closed"
