"""Ports out of the box through a real ``corral serve``: a server started in a box after the
box started, exposed as a host port and reached through the preview URL (HTTP both ways,
streamed, and a WebSocket), behind the server's auth; a port nothing listens on answers 502 at
once, and a deleted box's host port refuses connections."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets.asyncio.client

from served import CORRAL, Served, serving

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

READY_TIMEOUT = 30.0

# A box server with only the stdlib: files (http.server), POST echoing what it got (its
# length, digest and headers), and a WebSocket echo (RFC 6455, enough for the test: frames
# up to 64 KiB, text and binary, close) whose first message is the path it was asked for.
BOX_SERVER = r"""
import base64, hashlib, http.server, json, socket, struct, sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n)
        out = json.dumps({"len": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                          "path": self.path,
                          "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.send_header("x-box", "yes")
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        if self.path.startswith("/cut"):  # a chunked answer its server cuts half way
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"5\r\nhello\r\n")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if self.path.startswith("/login"):  # an app's session cookie, for the caller that logged in
            self.send_response(200)
            self.send_header("set-cookie", "session=SECRET; Path=/; HttpOnly")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if self.headers.get("upgrade", "").lower() != "websocket":
            return super().do_GET()
        key = self.headers["sec-websocket-key"].encode()
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        self.send_response(101)
        self.send_header("upgrade", "websocket")
        self.send_header("connection", "Upgrade")
        self.send_header("sec-websocket-accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.send_frame(1, self.path.encode())
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 15, head[1] & 127
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                self.send_frame(8, data[:2])
                return
            if op in (1, 2):
                self.send_frame(op, data)

    def send_frame(self, op, data):
        n = len(data)
        head = bytes([128 | op]) + (bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n))
        self.wfile.write(head + data)
        self.wfile.flush()

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

TOKEN_HEADERS: dict[str, str] = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    runtime = tmp_path_factory.mktemp("run")
    with serving(
        runtime, "--listen", "127.0.0.1:0", "--read-token", "read-only-token-for-ports"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("site")
    (ws / "server.py").write_text(BOX_SERVER)
    (ws / "big.bin").write_bytes(os.urandom(24 << 20))
    ws.chmod(0o755)
    return ws


def client(served: Served, token: str | None = "") -> httpx.Client:
    headers = {"Authorization": f"Bearer {served.token if token == '' else token}"}
    if token is None:
        headers = {}
    return httpx.Client(base_url=served.url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def box(served: Served, site: Path) -> Iterator[str]:
    """A box serving ``site`` on box port 8000, started after the box."""
    with client(served) as c:
        made = c.post("/v1/boxes", json={"workspace": str(site)})
        assert made.status_code == 201, made.text
        box_id = made.json()["id"]
        started = c.post(
            f"/v1/boxes/{box_id}/run",
            json={"cmd": ["python3", "server.py", "8000"], "background": True},
        )
        assert started.status_code == 200, started.text
        yield box_id
        c.delete(f"/v1/boxes/{box_id}")


def wait_serving(c: httpx.Client, url: str) -> httpx.Response:
    """The box's server once it listens (it was just started): bounded."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        r = c.get(url)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)  # the server in the box is importing; ask again


def test_an_exposed_port_reaches_the_box_server_from_the_host(
    served: Served, box: str, site: Path
) -> None:
    with client(served) as c:
        r = c.post(f"/v1/boxes/{box}/ports", json={"port": 8000})
        assert r.status_code == 201, r.text
        port = r.json()
        assert port["port"] == 8000 and port["host_ip"] == "127.0.0.1"
        assert port["url"] == f"http://127.0.0.1:{port['host_port']}/"
        assert port["preview_path"] == f"/v1/boxes/{box}/ports/8000/"
        assert c.post(f"/v1/boxes/{box}/ports", json={"port": 8000}).json() == port  # again
        assert port in c.get(f"/v1/boxes/{box}/ports").json()
        assert (
            f"127.0.0.1:{port['host_port']}->8000/tcp"
            in c.get(f"/v1/boxes/{box}").json()["published"]
        )
        assert wait_serving(c, port["preview_path"] + "server.py").status_code == 200
    with httpx.Client(timeout=60) as direct:  # no corral token: the host port is the box's
        got = direct.get(port["url"] + "server.py")
        assert got.status_code == 200 and got.content == (site / "server.py").read_bytes()


def test_the_preview_url_streams_large_bodies_exactly_both_ways(
    served: Served, box: str, site: Path
) -> None:
    big = (site / "big.bin").read_bytes()
    with client(served) as c:
        assert wait_serving(c, f"/v1/boxes/{box}/ports/8000/server.py").status_code == 200
        digest = hashlib.sha256()
        size = 0
        with c.stream("GET", f"/v1/boxes/{box}/ports/8000/big.bin") as r:
            assert r.status_code == 200
            assert r.headers["content-length"] == str(len(big))
            for chunk in r.iter_raw():
                digest.update(chunk)
                size += len(chunk)
        assert size == len(big) and digest.digest() == hashlib.sha256(big).digest()

        def upload() -> Iterator[bytes]:
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + (1 << 20)]

        r = c.post(
            f"/v1/boxes/{box}/ports/8000/echo?x=1&y=%2F",
            content=upload(),
            headers={"content-length": str(len(big)), "x-mine": "kept", "cookie": "corral=1"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-box"] == "yes"
        # One Date and one Server (corral's), as a reverse proxy answers: the box server
        # (http.server) sent its own of both.
        names = [k.lower() for k, _ in r.headers.raw]
        assert names.count(b"date") == 1 and names.count(b"server") == 1, r.headers.raw
        # the box's pages get an opaque origin in a browser: not the server's own pages
        assert r.headers["content-security-policy"].startswith("sandbox ")
        assert "allow-same-origin" not in r.headers["content-security-policy"]
        page_origin = {"Origin": "null"}  # what a sandboxed page's requests carry
        assert c.get(f"/v1/boxes/{box}/ports", headers=page_origin).status_code == 403
        echoed = r.json()
        assert echoed["len"] == len(big)
        assert echoed["sha256"] == hashlib.sha256(big).hexdigest()
        assert echoed["path"] == "/echo?x=1&y=%2F"
        assert echoed["headers"]["x-mine"] == "kept"
        # the box never sees the caller's corral credentials
        assert "authorization" not in echoed["headers"]
        assert "cookie" not in echoed["headers"]
        # A JSON body is the box server's business: not capped like the API's own JSON.
        payload = b'{"k": "' + b"x" * (3 << 20) + b'"}'
        r = c.post(
            f"/v1/boxes/{box}/ports/8000/echo",
            content=payload,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["len"] == len(payload)


def test_an_answer_the_box_cut_is_cut_through_the_preview_too(served: Served, box: str) -> None:
    """Relayed as a whole answer (the final chunk added), a cut one reached the caller as
    a success: it must break as it does from the box's own port."""
    with client(served) as c:
        c.post(f"/v1/boxes/{box}/ports", json={"port": 8000})
        preview = f"/v1/boxes/{box}/ports/8000/"
        assert wait_serving(c, preview + "server.py").status_code == 200
        with c.stream("GET", preview + "cut") as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                r.read()
        assert c.get(preview + "server.py").status_code == 200  # the next answer is whole


def test_the_preview_proxy_keeps_no_cookies_a_box_set(served: Served, box: str) -> None:
    """One box's Set-Cookie is for the caller that got it, never replayed by the proxy to
    a later request (from anyone, to this box or another)."""
    with client(served) as c:
        assert wait_serving(c, f"/v1/boxes/{box}/ports/8000/server.py").status_code == 200
        login = c.get(f"/v1/boxes/{box}/ports/8000/login")
        assert login.status_code == 200 and "SECRET" in login.headers["set-cookie"]
        c.cookies.clear()  # this caller sends no cookie: the proxy must not send one either
        echoed = c.post(f"/v1/boxes/{box}/ports/8000/echo", content=b"x").json()
        assert "cookie" not in echoed["headers"], echoed["headers"]


def test_the_preview_url_carries_a_websocket(served: Served, box: str) -> None:
    with client(served) as c:
        assert wait_serving(c, f"/v1/boxes/{box}/ports/8000/server.py").status_code == 200
    ws_url = served.url.replace("http://", "ws://") + f"/v1/boxes/{box}/ports/8000/ws?room=7"

    async def talk() -> None:
        async with asyncio.timeout(30):
            async with websockets.asyncio.client.connect(
                ws_url, additional_headers={"Authorization": f"Bearer {served.token}"}
            ) as ws:
                assert await ws.recv() == "/ws?room=7"
                await ws.send("hello box")
                assert await ws.recv() == "hello box"
                blob = os.urandom(40000)
                await ws.send(blob)
                assert await ws.recv() == blob
            # a browser's token in the query is for corral, not passed to the box
            async with websockets.asyncio.client.connect(ws_url + f"&token={served.token}") as ws:
                assert await ws.recv() == "/ws?room=7"

    asyncio.run(talk())


def test_the_preview_url_needs_an_operator_token(served: Served, box: str) -> None:
    path = f"/v1/boxes/{box}/ports/8000/server.py"
    with client(served, token=None) as c:
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    with client(served, token="read-only-token-for-ports") as c:
        r = c.get(path)
        assert r.status_code == 403 and r.json()["error"]["code"] == "access_denied"
        assert c.get(f"/v1/boxes/{box}/ports").status_code == 200  # listing is a look
        assert c.post(f"/v1/boxes/{box}/ports", json={"port": 9}).status_code == 403

    async def refused() -> None:
        ws_url = served.url.replace("http://", "ws://") + f"/v1/boxes/{box}/ports/8000/ws"
        async with asyncio.timeout(30):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refusal:
                await websockets.asyncio.client.connect(ws_url)
        assert refusal.value.response.status_code == 401  # refused as a plain request is
        assert b'"unauthorized"' in refusal.value.response.body

    asyncio.run(refused())


def test_a_port_nothing_listens_on_answers_502_at_once(served: Served, box: str) -> None:
    with client(served) as c:
        began = time.monotonic()
        r = c.get(f"/v1/boxes/{box}/ports/8011/")
        took = time.monotonic() - began
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "port_not_reachable" and "8011" in error["message"]
        assert took < 5, took
        assert c.post(f"/v1/boxes/{box}/ports", json={"port": 0}).status_code == 400
        # the same port in a URL's path: the same refusal, whatever the method
        for bad in ("0", "-1", "70000"):
            for method in ("GET", "POST", "DELETE"):
                tail = "" if method == "DELETE" else "/x"
                r = c.request(method, f"/v1/boxes/{box}/ports/{bad}{tail}")
                assert r.status_code == 400, (method, bad, r.text)
                assert r.json()["error"]["code"] == "invalid_input", r.text

    async def websocket() -> None:  # the handshake is refused, as a plain request is
        ws_url = served.url.replace("http://", "ws://") + f"/v1/boxes/{box}/ports/8012/"
        headers = {"Authorization": f"Bearer {served.token}"}
        async with asyncio.timeout(10):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refusal:
                await websockets.asyncio.client.connect(ws_url, additional_headers=headers)
        assert refusal.value.response.status_code == 502  # never accepted (101) first
        error = json.loads(refusal.value.response.body)["error"]
        assert error["code"] == "port_not_reachable" and "8012" in error["message"]

    asyncio.run(websocket())


def test_a_paused_boxs_preview_answers_409_at_once(served: Served, box: str) -> None:
    """As every other request to a paused box does: its frozen server would never answer."""
    path = f"/v1/boxes/{box}/ports/8000/server.py"
    with client(served) as c:
        assert wait_serving(c, path).status_code == 200
        assert c.post(f"/v1/boxes/{box}/pause").status_code == 200
        try:
            r = c.get(path, timeout=10)
            assert (r.status_code, r.json()["error"]["code"]) == (409, "sandbox_paused"), r.text
            assert "resume" in r.json()["error"]["message"]

            async def websocket() -> None:
                ws_url = served.url.replace("http://", "ws://") + f"/v1/boxes/{box}/ports/8000/ws"
                headers = {"Authorization": f"Bearer {served.token}"}
                async with asyncio.timeout(10):
                    with pytest.raises(websockets.exceptions.InvalidStatus) as refusal:
                        await websockets.asyncio.client.connect(ws_url, additional_headers=headers)
                assert refusal.value.response.status_code == 409
                assert b'"sandbox_paused"' in refusal.value.response.body

            asyncio.run(websocket())
        finally:
            assert c.post(f"/v1/boxes/{box}/resume").status_code == 200
        assert c.get(path, timeout=10).status_code == 200


def refuses(host_port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(10)
        try:
            s.connect(("127.0.0.1", host_port))
        except ConnectionRefusedError:
            return True
        return False


def test_unexposed_and_deleted_boxes_ports_refuse_connections(served: Served, site: Path) -> None:
    with client(served) as c:
        made = c.post("/v1/boxes", json={"workspace": str(site)})
        assert made.status_code == 201, made.text
        box_id = made.json()["id"]
        c.post(
            f"/v1/boxes/{box_id}/run",
            json={"cmd": ["python3", "server.py", "8000"], "background": True},
        )
        first = c.post(f"/v1/boxes/{box_id}/ports", json={"port": 8000}).json()
        assert wait_serving(c, first["preview_path"] + "server.py").status_code == 200
        assert c.delete(f"/v1/boxes/{box_id}/ports/8000").status_code == 204
        assert refuses(first["host_port"])
        assert c.get(f"/v1/boxes/{box_id}/ports").json() == []
        again = c.post(f"/v1/boxes/{box_id}/ports", json={"port": 8000}).json()
        assert httpx.get(again["url"] + "server.py").status_code == 200
        assert c.delete(f"/v1/boxes/{box_id}").status_code == 204
        assert refuses(again["host_port"])
        r = c.get(again["preview_path"])
        assert r.status_code == 404 and r.json()["error"]["code"] == "box_not_found"


def test_the_remote_sdk_exposes_a_port(served: Served, site: Path) -> None:
    import corral

    async def use() -> None:
        async with corral.connect(served.url, token=served.token) as remote:
            async with remote.Sandbox(workspace=site) as sb:
                await sb.spawn(["python3", "server.py", "8000"])
                exposed = await sb.expose(8000)
                assert exposed.box_port == 8000 and exposed.host_port > 0
                assert exposed.url == f"http://127.0.0.1:{exposed.host_port}/"
                assert exposed.preview_url == f"{served.url}/v1/boxes/{sb.id}/ports/8000/"
                assert await sb.ports() == [exposed]
                await sb.unexpose(8000)
                assert await sb.ports() == []
            assert refuses(exposed.host_port)

    asyncio.run(use())


def test_corral_port_prints_the_urls(served: Served, box: str, tmp_path: Path) -> None:
    def port(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CORRAL, "port", box, *args],
            env=served.env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = port("8000")
    assert made.returncode == 0, made.stderr
    number, url, preview = made.stdout.split()
    assert number == "8000" and url.startswith("http://127.0.0.1:")
    assert preview == f"{served.url}/v1/boxes/{box}/ports/8000/"
    assert made.stdout in port().stdout  # ID alone: the list
    assert httpx.get(url + "server.py").status_code == 200
    bad = port("70000")
    assert bad.returncode == 2 and "invalid_input" in bad.stderr, bad.stderr
