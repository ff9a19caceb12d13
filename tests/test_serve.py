"""``corral serve`` for real: a server in a subprocess on a unix socket or 127.0.0.1, driven
by the CLI, plain HTTP, a WebSocket client and the remote SDK, with real boxes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.asyncio.client

import corral
from corral.backends.host.state import state_root
from corral.streaming import Exited, Stdout
from served import CORRAL, Served, serving, start

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

DOCS_OPENAPI = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    runtime = tmp_path_factory.mktemp("run")
    with serving(runtime, "--socket", str(runtime / "s.sock")) as served:
        yield served


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    runtime = tmp_path_factory.mktemp("run")
    with serving(
        runtime, "--listen", "127.0.0.1:0", "--read-token", "read-only-token-for-tests"
    ) as served:
        yield served


def http(served: Served, token: str | None = None) -> httpx.Client:
    if served.url.startswith("unix:"):
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=served.socket), base_url="http://localhost"
        )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=served.url, headers=headers)


def raw_post(served: Served, length: int, timeout: float | None = None) -> socket.socket:
    """A connection to a TCP server that has sent the head of ``POST /v1/boxes`` declaring
    ``length`` bytes of body, and the body's first byte: what a test of a slow, oversize or
    trickled body sends by hand (no client library sends a body it does not have)."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(
        f"POST /v1/boxes HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer "
        f"{served.token}\r\nContent-Type: application/json\r\nContent-Length: {length}"
        "\r\n\r\n{".encode()
    )
    return sock


def cli(
    served: Served, *args: str, cwd: Path, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CORRAL, *args], env=served.env, cwd=cwd, input=stdin, capture_output=True, timeout=120
    )


def metric(served: Served, name: str) -> float:
    with http(served) as client:
        text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


# ---- corral run through the server ---------------------------------------------------------
def test_run_goes_through_the_server_byte_for_byte(server: Served, workspace: Path) -> None:
    blob = os.urandom(1 << 20)
    (workspace / "blob").write_bytes(blob)
    starts = metric(server, "corral_box_starts_total")
    r = cli(server, "run", "--", "cat", "blob", cwd=workspace)
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(r.stdout).digest() == hashlib.sha256(blob).digest()
    assert metric(server, "corral_box_starts_total") == starts + 1  # the server ran it
    r = cli(
        server,
        "run",
        "--stdin",
        "--",
        "sh",
        "-c",
        "cat; echo err >&2; exit 3",
        cwd=workspace,
        stdin=b"\x00\xffin",
    )
    assert (r.returncode, r.stdout) == (3, b"\x00\xffin")
    assert r.stderr.endswith(b"err\n")


def test_stdin_larger_than_one_box_message_reaches_the_command_whole(
    server: Served, workspace: Path
) -> None:
    # A message to the box carries at most 16 MiB: a larger stdin once became an empty one.
    data = os.urandom(20_000_000)
    digest = hashlib.sha256(data).hexdigest().encode()
    r = cli(server, "run", "--stdin", "--", "sha256sum", cwd=workspace, stdin=data)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == digest
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        r = cli(server, "exec", "-i", box, "--", "sha256sum", cwd=workspace, stdin=data)
        assert (r.returncode, r.stdout.split()[0]) == (0, digest), r.stderr
        r = cli(server, "exec", "-i", box, "--", "head", "-c", "3", cwd=workspace, stdin=data)
        assert (r.returncode, r.stdout) == (0, data[:3]), r.stderr  # stopped reading: fine
    finally:
        cli(server, "rm", box, cwd=workspace)


def test_run_through_the_server_keeps_the_cli_statuses(server: Served, workspace: Path) -> None:
    r = cli(server, "run", "--", "no-such-program", cwd=workspace)
    assert r.returncode == 127
    assert b"command not found" in r.stderr
    r = cli(server, "run", "--timeout", "0.5", "--", "sleep", "30", cwd=workspace)
    assert r.returncode == 124
    assert b"timed out after 0.5 s" in r.stderr
    r = cli(server, "run", "--json", "--", "sh", "-c", "echo hi; exit 4", cwd=workspace)
    assert r.returncode == 4
    assert json.loads(r.stdout)["stdout"] == "hi\n"
    r = cli(server, "run", "--cpus", "-1", "--", "true", cwd=workspace)
    assert r.returncode == 2
    assert b"--cpus" in r.stderr
    assert b"Traceback" not in r.stderr
    r = cli(server, "run", "--", "true", cwd=Path("/"))
    assert r.returncode == 2
    assert b"refusing /" in r.stderr


def test_run_through_the_server_passes_arguments_that_are_not_utf8(
    server: Served, workspace: Path
) -> None:
    # As in-process: a name in Latin-1 (not UTF-8) reaches the box's command byte for byte.
    name = os.fsdecode(b"caf\xe9.txt")
    (workspace / name).write_bytes(b"latin\n")
    r = cli(server, "run", "--", "cat", name, cwd=workspace)
    assert (r.returncode, r.stdout) == (0, b"latin\n"), r.stderr
    r = cli(server, "run", "--", "printf", "%s", os.fsdecode(b"a\xffb"), cwd=workspace)
    assert (r.returncode, r.stdout) == (0, b"a\xffb"), r.stderr
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:  # and corral cp, both ways, a directory of such names included
        (workspace / "d").mkdir()
        (workspace / "d" / name).write_bytes(b"in dir\n")
        r = cli(server, "cp", name, f"{box}:copy-{name}", cwd=workspace)
        assert r.returncode == 0, r.stderr
        r = cli(server, "cp", f"{box}:copy-{name}", f"back-{name}", cwd=workspace)
        assert r.returncode == 0, r.stderr
        assert (workspace / f"back-{name}").read_bytes() == b"latin\n"
        r = cli(server, "cp", f"{box}:d", "d-back", cwd=workspace)
        assert r.returncode == 0, r.stderr
        assert (workspace / "d-back" / name).read_bytes() == b"in dir\n"
    finally:
        cli(server, "rm", box, cwd=workspace)


def test_a_command_or_directory_not_utf8_that_fails_to_start_is_127_or_126(
    server: Served, workspace: Path
) -> None:
    # Its name in the note once made the server fail (internal_error, 125).
    name = os.fsdecode(b"caf\xe9")
    (workspace / name).write_text("a file, not a directory\n")
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        for args, status in (
            (("run", "--", f"./nope{name}"), 127),
            (("exec", box, "--", f"./nope{name}"), 127),
            (("exec", "-w", f"/workspace/{name}", box, "--", "true"), 126),
        ):
            r = cli(server, *args, cwd=workspace)
            assert r.returncode == status, (args, r.stderr)
            assert r.stderr.startswith(b"corral: ") and b"caf\\udce9" in r.stderr, r.stderr
            assert r.stderr.count(b"\n") == 1, r.stderr
    finally:
        cli(server, "rm", box, cwd=workspace)


def test_run_json_through_the_server_says_what_it_says_in_process(
    server: Served, workspace: Path, tmp_path: Path
) -> None:
    # Through the server, errors were a plain line on stderr (stdout empty) and bytes that
    # are not UTF-8 became U+FFFD without the note: each as in-process now.
    local = {**server.env, "CORRAL_HOST": "local"}
    nowhere = {**server.env, "CORRAL_HOST": f"unix:{tmp_path / 'none.sock'}"}
    for args in (("--memory", "abc", "--", "true"), ("--", "printf", "a\\377b")):
        here, there = (
            subprocess.run(
                [*CORRAL, "run", "--json", *args],
                env=env,
                cwd=workspace,
                capture_output=True,
                timeout=60,
            )
            for env in (local, server.env)
        )
        got, want = json.loads(there.stdout), json.loads(here.stdout)
        for result in (got, want):
            result.pop("duration_ms", None)
        assert (there.returncode, got, there.stderr) == (here.returncode, want, here.stderr)
    assert b"U+FFFD" in there.stderr
    r = subprocess.run(
        [*CORRAL, "run", "--json", "--", "true"],
        env=nowhere,
        cwd=workspace,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 125, r.stderr
    assert json.loads(r.stdout)["error"]["code"] == "server_unavailable"


def test_run_publish_through_the_server_as_readme_says(server: Served, workspace: Path) -> None:
    # README's `corral run -p 8080:8000 -- python3 -m http.server 8000` was refused through a
    # server (a pool cannot publish a fixed host port), and `-p 0:8000` never said its port.
    (workspace / "index.html").write_text("hello from the box\n")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        host_port = probe.getsockname()[1]  # a free port, released for corral to take
    argv = [*CORRAL, "run", "-p", f"{host_port}:8000", "--"]
    argv += ["python3", "-u", "-m", "http.server", "8000"]
    proc = subprocess.Popen(
        argv, env=server.env, cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and b"Serving HTTP" in proc.stdout.readline()
        url = f"http://127.0.0.1:{host_port}/index.html"
        assert httpx.get(url, timeout=30).text == "hello from the box\n"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    r = cli(server, "run", "-p", "0:8000", "--", "true", cwd=workspace)
    assert r.returncode == 0, r.stderr
    line = r.stderr.decode()
    assert line.startswith("corral: published 127.0.0.1:") and line.endswith("->8000/tcp\n")


def test_run_through_the_server_says_the_presets_it_picks(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The line went into the server's log; README: corral run says so on stderr.
    home = tmp_path / "home"
    (home / ".cargo" / "bin").mkdir(parents=True)
    (home / ".cargo" / "bin" / "cargo").write_text("#!/bin/sh\necho fake cargo\n")
    (home / ".rustup").mkdir()
    monkeypatch.setenv("HOME", str(home))  # the server's: presets are its user's toolchains
    (workspace / "Cargo.toml").write_text("[package]\n")
    with serving(tmp_path / "run", "--socket", str(tmp_path / "s.sock")) as served:
        r = cli(served, "run", "--", "true", cwd=workspace)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith(b"corral: preset rust (Cargo.toml"), r.stderr


def test_a_malformed_run_header_is_one_sentence(server: Served) -> None:
    with http(server) as client:
        for header, says in (('{"argv": [1]}', "argv.0: "), ("{nope", "line 1 column 2")):
            r = client.post("/v1/cli/run", headers={"X-Corral-Run": header})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["code"] == "invalid_input"
            assert error["message"].startswith("bad X-Corral-Run header: ")
            assert says in error["message"] and "\n" not in error["message"]


def test_boxes_are_filtered_by_labels_that_are_not_utf8(server: Served) -> None:
    # A label set in JSON as a lone surrogate (how Python spells a byte that is not UTF-8) is
    # found by the same byte in the query, not mistaken for any other undecodable byte.
    with http(server) as client:
        box = client.post(
            "/v1/boxes", content=b'{"labels": {"who": "caf\\udce9"}}', headers=_JSON
        ).json()["id"]
        try:
            found = [b["id"] for b in client.get("/v1/boxes?label=who=caf%E9").json()]
            assert found == [box]
            assert client.get("/v1/boxes?label=who=caf%E8").json() == []
        finally:
            client.delete(f"/v1/boxes/{box}")


_JSON = {"content-type": "application/json"}


LOADED_AT_EXIT = """
import atexit, sys
atexit.register(lambda: print(*sorted(sys.modules), file=sys.stderr))
from corral.client.cli import console
sys.argv = ["corral", *sys.argv[1:]]
console()
"""
"""The console script, which prints the modules it loaded once the command is done (its
exit runs the atexit handlers: corral.client.cli.exit_now)."""


def test_run_through_the_server_imports_only_the_c_halves(server: Served, workspace: Path) -> None:
    # The interpreter's start is most of what a `corral run` through a server costs; the
    # Python layers of json and socket (re, enum, selectors, ...) were another half of it.
    heavy = {"json", "socket", "re", "enum", "selectors", "typing", "argparse"}
    heavy |= {"asyncio", "pydantic", "corral.policy", "corral.sandbox", "threading"}
    r = subprocess.run(
        [sys.executable, "-c", LOADED_AT_EXIT, "run", "--", "sh", "-c", "echo hi; exit 3"],
        env=server.env,
        cwd=workspace,
        capture_output=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (3, b"hi\n"), r.stderr
    loaded = set(r.stderr.decode().split())
    assert {"corral.client.fast", "_socket", "_json"} <= loaded  # it went through the server
    assert loaded & heavy == set()


def test_a_server_that_is_not_there_is_named(tmp_path: Path, workspace: Path) -> None:
    env = {**os.environ, "CORRAL_HOST": f"unix:{tmp_path / 'none.sock'}"}
    r = subprocess.run(
        [*CORRAL, "run", "--", "true"], env=env, cwd=workspace, capture_output=True, timeout=60
    )
    assert r.returncode == 125
    assert b"server_unavailable" in r.stderr
    assert b"corral serve" in r.stderr
    r = subprocess.run([*CORRAL, "ps"], env=env, cwd=workspace, capture_output=True, timeout=60)
    assert r.returncode == 125


# ---- boxes that outlive a call -------------------------------------------------------------
def test_create_exec_cp_logs_ps_rm(server: Served, workspace: Path, tmp_path: Path) -> None:
    r = cli(server, "create", "--label", "job=t1", "--", "--network", "none", cwd=workspace)
    assert r.returncode == 0, r.stderr
    box = r.stdout.decode().strip()
    assert box.startswith("box-")
    try:
        payload = os.urandom(300_000)
        (tmp_path / "in.bin").write_bytes(payload)
        assert (
            cli(server, "cp", str(tmp_path / "in.bin"), f"{box}:in.bin", cwd=tmp_path).returncode
            == 0
        )
        r = cli(server, "exec", box, "--", "sha256sum", "in.bin", cwd=tmp_path)
        assert r.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()
        assert (
            cli(server, "exec", box, "--", "sh", "-c", "echo x > made.txt", cwd=tmp_path).returncode
            == 0
        )
        assert (workspace / "made.txt").read_text() == "x\n"  # the box's workspace
        assert (
            cli(server, "cp", f"{box}:in.bin", str(tmp_path / "out.bin"), cwd=tmp_path).returncode
            == 0
        )
        assert (tmp_path / "out.bin").read_bytes() == payload
        r = cli(server, "exec", box, "--", "sh", "-c", "exit 7", cwd=tmp_path)
        assert r.returncode == 7
        r = cli(server, "ps", "--json", cwd=tmp_path)
        assert [b["labels"] for b in json.loads(r.stdout) if b["id"] == box] == [{"job": "t1"}]
        with http(server) as client:
            started = client.post(
                f"/v1/boxes/{box}/run", json={"cmd": "echo bg; echo bg-err >&2", "background": True}
            ).json()
            client.post(f"/v1/boxes/{box}/processes/{started['pid']}/wait", params={"timeout": 30})
        r = cli(server, "logs", box, str(started["pid"]), cwd=tmp_path)
        assert (r.stdout, r.stderr) == (b"bg\n", b"bg-err\n")
        r = cli(server, "ps", box, cwd=tmp_path)
        assert str(started["pid"]).encode() in r.stdout
    finally:
        assert cli(server, "rm", box, cwd=tmp_path).returncode == 0
    # an id that is not there is the caller's mistake, as a bad flag is: 2 and one line
    for args in (("exec", box, "--", "true"), ("logs", box, "1"), ("rm", box), ("ps", box)):
        r = cli(server, *args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(b"corral: [box_not_found] ") and r.stderr.count(b"\n") == 1
    live = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        r = cli(server, "logs", live, "999", cwd=tmp_path)
        assert r.returncode == 2 and b"[process_not_found]" in r.stderr, r.stderr
        r = cli(server, "rm", box, live, cwd=tmp_path)  # the missing one said, the other closed
        assert r.returncode == 2 and r.stderr.count(b"\n") == 1, r.stderr
        r = cli(server, "ps", live, cwd=tmp_path)
        assert r.returncode == 2 and b"[box_not_found]" in r.stderr, r.stderr
    finally:
        cli(server, "rm", live, cwd=tmp_path)


def test_exec_flags_after_the_box_id_are_exec_s(server: Served, workspace: Path) -> None:
    # `corral exec ID -i -- cat` once ran `-i` as the command (127): REMAINDER took it.
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        r = cli(server, "exec", box, "-i", "--", "cat", cwd=workspace, stdin=b"hi\n")
        assert (r.returncode, r.stdout) == (0, b"hi\n"), r.stderr
        r = cli(server, "exec", box, "--timeout", "30", "-w", "/tmp", "--", "pwd", cwd=workspace)
        assert (r.returncode, r.stdout) == (0, b"/tmp\n"), r.stderr
        r = cli(server, "exec", box, "-e", "X=1", "sh", "-c", "echo $X -i", cwd=workspace)
        assert (r.returncode, r.stdout) == (0, b"1 -i\n"), r.stderr  # no --: from the command on
        r = cli(server, "exec", box, "--", "echo", "--", "-i", cwd=workspace)
        assert (r.returncode, r.stdout) == (0, b"-- -i\n"), r.stderr  # after --: the command's
    finally:
        cli(server, "rm", box, cwd=workspace)


def test_a_label_that_is_not_k_v_is_refused(server: Served, workspace: Path) -> None:
    # `--label nolabel` and `--label =x` were taken as the label "nolabel=" and an empty key.
    before = json.loads(cli(server, "ps", "--json", cwd=workspace).stdout)
    for bad in ("nolabel", "=x"):
        r = cli(server, "create", "--label", bad, cwd=workspace)
        assert r.returncode == 2 and b"[invalid_input] --label" in r.stderr, r.stderr
    assert json.loads(cli(server, "ps", "--json", cwd=workspace).stdout) == before


def test_a_slow_logs_follower_does_not_slow_the_process(server: Served) -> None:
    # `corral logs -f` watches a background process: a reader that stops must not hold it
    # (an exec stream does hold its own command); it is told what it missed instead.
    from corral.client import frames

    with http(server) as client, http(server) as watcher:
        box = client.post("/v1/boxes", json={}).json()["id"]
        try:
            started = client.post(
                f"/v1/boxes/{box}/run",
                json={"cmd": "sleep 0.5; head -c 48000000 /dev/zero", "background": True},
            ).json()
            where = f"/v1/boxes/{box}/processes/{started['pid']}"
            with watcher.stream("GET", f"{where}/follow") as follow:
                # Not read meanwhile: 48 MB is far past what the sockets and 4 MiB take.
                waited = client.post(f"{where}/wait", params={"timeout": 60}, timeout=90).json()
                assert (waited["status"], waited["exit_code"]) == ("exited", 0), waited
                got = bytearray(b"".join(follow.iter_bytes()))
            kinds = [(kind, data) for kind, data in frames.split_frames(got)]
            notes = [data for kind, data in kinds if kind == frames.NOTE]
            assert any(b"bytes of output skipped" in note for note in notes), notes
            shown = sum(len(data) for kind, data in kinds if kind == frames.STDOUT)
            skipped = sum(
                int(note.split()[1]) for note in notes if b"bytes of output skipped" in note
            )
            assert shown + skipped >= 48000000 - (1 << 20)  # the captured head and tail aside
        finally:
            client.delete(f"/v1/boxes/{box}")


def test_logs_say_when_the_output_was_cut(server: Served, workspace: Path) -> None:
    box = cli(server, "create", "--", "--output-bytes", "100000", cwd=workspace)
    box_id = box.stdout.decode().strip()
    assert box.returncode == 0, box.stderr
    try:
        with http(server) as client:
            started = client.post(
                f"/v1/boxes/{box_id}/run",
                json={"cmd": "yes | head -c 300000", "background": True},
            ).json()
            client.post(
                f"/v1/boxes/{box_id}/processes/{started['pid']}/wait", params={"timeout": 30}
            )
        for follow in ([], ["-f"]):
            r = cli(server, "logs", *follow, box_id, str(started["pid"]), cwd=workspace)
            assert r.returncode == 0, r.stderr
            assert 0 < len(r.stdout) < 300000
            assert r.stderr.count(b"\n") == 1, r.stderr
            assert b"output truncated" in r.stderr and b"corral cp" in r.stderr, r.stderr
    finally:
        cli(server, "rm", box_id, cwd=workspace)


def _interrupted(served: Served, cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``corral ARGS`` given a Ctrl-C (SIGINT) once its command printed ``ready``."""
    proc = subprocess.Popen(
        [*CORRAL, *args], env=served.env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and os.read(proc.stdout.fileno(), 100) == b"ready\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_through_the_server_ends_the_command_quietly(
    server: Served, workspace: Path
) -> None:
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        script = "trap 'exit 5' TERM; echo ready; sleep 100 & wait"
        r = _interrupted(server, workspace, "exec", box, "--", "sh", "-c", script)
        assert (r.returncode, r.stderr) == (130, b""), r.stderr
        with http(server) as client:
            (pid,) = [p["pid"] for p in client.get(f"/v1/boxes/{box}/processes").json()]
            ended = client.post(
                f"/v1/boxes/{box}/processes/{pid}/wait", params={"timeout": 30}, timeout=60
            ).json()
        assert ended["exit_code"] == 5, ended  # SIGTERM reached it: ended as the library ends
        r = cli(server, "exec", box, "--", "echo", "alive", cwd=workspace)
        assert (r.returncode, r.stdout) == (0, b"alive\n"), r.stderr  # the box still works
        r = _interrupted(server, workspace, "run", "--", "sh", "-c", script)
        assert (r.returncode, r.stderr) == (130, b""), r.stderr
    finally:
        cli(server, "rm", box, cwd=workspace)


# ---- the remote SDK has the library's API ------------------------------------------------
@pytest.fixture(params=["local", "remote"])
async def make_box(request: pytest.FixtureRequest, server: Served) -> AsyncIterator[Any]:
    """The same test body against ``corral.Sandbox`` and ``remote.Sandbox``."""
    if request.param == "local":
        yield corral.Sandbox
        return
    async with corral.connect(server.url) as remote:
        yield remote.Sandbox


async def test_the_same_code_runs_local_and_remote(make_box: Any, workspace: Path) -> None:
    async with make_box(workspace=workspace) as sb:
        r = await sb.run("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr, r.ended) == (3, "out\n", "err\n", "exited")
        r = await sb.run(["cat"], stdin=b"\x00bytes\xff")
        assert r.stdout.encode("utf-8", "surrogateescape").startswith(b"\x00bytes")
        r = await sb.run("sleep 30", timeout=0.5)
        assert (r.timed_out, r.timeout, r.ended) == (True, 0.5, "timed_out")
        assert await sb.files.write("dir/f.bin", bytes(range(256))) == 256
        assert await sb.files.read("dir/f.bin") == bytes(range(256))
        assert (workspace / "dir" / "f.bin").read_bytes() == bytes(range(256))
        assert [f.name for f in await sb.files.list("dir")] == ["f.bin"]
        with pytest.raises(corral.FileNotFound):
            await sb.files.read("missing")
        proc = await sb.spawn("sleep 0.1; echo done")
        assert (await proc.wait(30)).exit_code == 0
        events = [ev async for ev in sb.exec_stream(["sh", "-c", "echo a; exit 5"])]
        assert [type(e).__name__ for e in events] == ["Stdout", "Exited"]
        assert events[-1].code == 5
        stream = await sb.exec_stream(["echo", "awaited"])
        first, *_ = [e async for e in stream]
        assert first.data == b"awaited\n"


async def test_the_stream_api_is_the_same_local_and_remote(make_box: Any, workspace: Path) -> None:
    """``async with``, ``wait``, ``kill``, ``signal``, stdin and an early ``break`` behave
    alike on both (the remote stream had only iteration and, with stdin, writes)."""
    async with make_box(workspace=workspace) as sb:
        async with sb.exec_stream(["sh", "-c", "echo hi; exit 4"]) as stream:
            assert await stream.wait(30) == 4
        stream = await sb.exec_stream("sleep 60")
        with pytest.raises(corral.Timeout):
            await stream.wait(0.3)  # the command goes on
        assert await stream.kill() is True
        assert await stream.wait(30) == -9
        async with sb.exec_stream(["cat"], stdin="pipe") as piped:
            await piped.write(b"through stdin\n")
            await piped.close_stdin()
            got = [e async for e in piped]
        assert got[0].data == b"through stdin\n" and got[-1].code == 0
        nopipe = await sb.exec_stream(["true"])
        with pytest.raises(corral.SandboxError, match="no stdin"):
            await nopipe.write(b"x")
        assert await nopipe.wait(30) == 0
        # Leaving the loop early ends the command (TERM, the grace, KILL).
        async for event in sb.exec_stream(["sh", "-c", "echo up; exec sleep 60"]):
            assert event.data == b"up\n"
            break
        deadline = time.monotonic() + 30
        while "sleep 60" in (await sb.run("ps -eo args")).stdout:
            assert time.monotonic() < deadline, "the command outlived the loop it was read in"
            await asyncio.sleep(0.05)


async def test_file_sizes_and_empty_reads_local_and_remote(make_box: Any, workspace: Path) -> None:
    # Over the server's 4 MiB write chunk: each chunk once added the file's running size.
    data = bytes(range(256)) * 40000
    async with make_box(workspace=workspace) as sb:
        assert await sb.files.write("bin.dat", data) == len(data)
        assert await sb.files.write("bin.dat", b"+", append=True) == len(data) + 1
        assert await sb.files.read("bin.dat", offset=10, length=0) == b""
        assert await sb.files.read("bin.dat", offset=10, length=3) == data[10:13]


def test_files_content_counts_what_arrived(server: Served, workspace: Path) -> None:
    data = os.urandom(9 << 20)
    with http(server) as client:
        box = client.post("/v1/boxes", json={"workspace": str(workspace)}).json()["id"]
        try:
            url = f"/v1/boxes/{box}/files/content"
            r = client.put(url, params={"path": "big.bin"}, content=data)
            assert r.json() == {"path": "big.bin", "bytes": len(data), "size": len(data)}
            r = client.put(url, params={"path": "big.bin", "append": "true"}, content=b"ab")
            assert r.json() == {"path": "big.bin", "bytes": 2, "size": len(data) + 2}
            r = client.get(url, params={"path": "big.bin", "offset": 100, "length": 0})
            assert (r.status_code, r.content) == (200, b"")
        finally:
            client.delete(f"/v1/boxes/{box}")


async def test_names_that_are_not_utf8_local_and_remote(make_box: Any, workspace: Path) -> None:
    # The library hands out such a name as os.fsdecode does (lone surrogates), and takes it
    # back the same way; over HTTP it must survive JSON, query strings and exec's argv.
    name = os.fsdecode(b"caf\xe9")
    (workspace / "given").mkdir()
    (workspace / "given" / f"{name}.txt").write_bytes(b"latin\n")
    async with make_box(workspace=workspace) as sb:
        listed = [f.name for f in await sb.files.list("given")]
        assert listed == [f"{name}.txt"]
        assert await sb.files.read(f"given/{listed[0]}") == b"latin\n"
        assert (await sb.files.stat(f"given/{name}.txt")) is not None
        await sb.files.mkdir(f"{name}-dir")
        assert await sb.files.write(f"{name}-dir/{name}.bin", b"\xff") == 1
        assert (workspace / f"{name}-dir" / f"{name}.bin").read_bytes() == b"\xff"
        r = await sb.run(["cat", f"given/{name}.txt"], cwd=f"/workspace/{name}-dir/..")
        assert (r.exit_code, r.stdout) == (0, "latin\n")
        events = [e async for e in sb.exec_stream(["printf", "%s", name], env={"N": name})]
        assert events[0].data == b"caf\xe9"
        await sb.files.remove(f"{name}-dir", recursive=True)
        assert not (workspace / f"{name}-dir").exists()
        # Text written with such a name's bytes: a file's content, a terminal's keys.
        assert await sb.files.write("text.txt", f"{name}\n") == 5
        assert (workspace / "text.txt").read_bytes() == b"caf\xe9\n"
        session = await sb.shell()
        await session.write(f"printf '%s' {name} | od -An -tx1\n")
        found = await session.expect("63 61 66 e9", 10)  # a Match here, its dict remotely
        assert found["matched"] if isinstance(found, dict) else found.matched
        with pytest.raises(corral.SandboxError) as bad:
            await sb.files.write("no.txt", "\ud800")  # a surrogate that is no byte
        assert bad.value.code == "invalid_input"
        assert (await sb.run("echo the box too")).stdout == "the box too\n"


async def test_processes_and_checks_local_and_remote(make_box: Any, workspace: Path) -> None:
    async with make_box(workspace=workspace) as sb:
        r = await sb.run("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "hi"})
        assert r.stdout == "/tmp\nhi\n"
        with pytest.raises(corral.CommandFailed):
            await sb.run("exit 9", check=True)
        proc = await sb.spawn(["sleep", "60"])
        assert await proc.signal("SIGTERM")
        done = await proc.wait(30)
        assert (done.status, done.exit_code) == ("exited", -15)
        with pytest.raises(corral.FileNotFound):
            await sb.files.remove("nothing-here")
        await sb.files.mkdir("a/b")
        assert await sb.files.exists("a/b")


@pytest.fixture(params=["local", "remote"])
async def make_pool(request: pytest.FixtureRequest, server: Served) -> AsyncIterator[Any]:
    if request.param == "local":
        async with corral.SandboxPool(size=1) as pool:
            yield pool
        return
    async with corral.connect(server.url) as remote, remote.SandboxPool(size=1) as pool:
        yield pool


async def test_pool_one_shots_local_and_remote(make_pool: Any, workspace: Path) -> None:
    (workspace / "in.txt").write_text("from the host\n")
    r = await make_pool.run("cat in.txt; echo out > out.txt", workspace=workspace)
    assert (r.exit_code, r.stdout) == (0, "from the host\n")
    assert (workspace / "out.txt").read_text() == "out\n"
    r = await make_pool.run(["cat"], stdin=b"piped", workspace=workspace)
    assert r.stdout == "piped"


async def test_remote_errors_are_the_library_classes(server: Served) -> None:
    async with corral.connect(server.url) as remote:
        with pytest.raises(corral.PolicyError, match="memory_bytes"):
            await remote.json(
                "POST", "/v1/boxes", json={"policy": {"limits": {"memory_bytes": "1k"}}}
            )
        gone = remote.Sandbox()
        gone.id = "box-000000000000"
        with pytest.raises(corral.BoxNotFound):
            await gone.run("true")
        assert await remote.boxes() == []  # the refused box was never made


# ---- who may call ------------------------------------------------------------------------
def test_the_token_file_is_found_when_the_host_is_spelt_localhost(
    tcp_server: Served, workspace: Path
) -> None:
    env = {**tcp_server.env, "CORRAL_HOST": tcp_server.url.replace("127.0.0.1", "localhost")}
    env.pop("CORRAL_TOKEN")  # only the server's own token file can say it
    r = subprocess.run(
        [*CORRAL, "ps"], env=env, cwd=workspace, capture_output=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr


def test_tcp_needs_a_token_of_the_right_scope(tcp_server: Served) -> None:
    with http(tcp_server) as anonymous:
        r = anonymous.get("/v1/boxes")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
        assert anonymous.get("/v1/health").status_code == 200
    with http(tcp_server, "wrong") as wrong:
        assert wrong.get("/v1/boxes").status_code == 401
    with http(tcp_server, "read-only-token-for-tests") as reader:
        assert reader.get("/v1/boxes").status_code == 200
        r = reader.post("/v1/boxes", json={})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "access_denied")
    with http(tcp_server, tcp_server.token) as operator:
        assert operator.get("/v1/boxes").json() == []
        r = operator.get("/v1/boxes", headers={"Host": "attacker.example:80"})
        assert r.status_code == 421  # DNS rebinding: another name for 127.0.0.1
        r = operator.get("/v1/boxes", headers={"Origin": "http://attacker.example"})
        assert r.status_code == 403
        r = operator.post(
            "/v1/boxes",
            content=b"{" + b" " * (2 << 20) + b"}",
            headers={"content-type": "application/json"},
        )
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        r = operator.post("/v1/boxes", json={"ttl_secs": -1})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input")
        r = operator.post("/v1/boxes", json={"policy": {"network": {"mode": "sideways"}}})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_policy")
        r = operator.get("/v1/boxes/box-nope/processes")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "box_not_found")
        assert operator.get("/v1/boxes").json() == []  # nothing was made by bad input
    token_file = tcp_server.runtime / "corral"
    assert any(p.stat().st_mode & 0o777 == 0o600 for p in token_file.glob("serve-*.token"))


def test_behind_a_tls_proxy_and_on_every_address(tmp_path: Path, workspace: Path) -> None:
    """A proxy in front sends the name its clients used, with its own port or none, and its
    page's origin is https; a server on every address answers at its addresses (loopback's
    is printed, and the CLI finds its token) and still refuses other names."""
    with serving(
        tmp_path / "run",
        "--listen",
        "0.0.0.0:0",
        "--allow-host",
        "corral.example.com:443",
    ) as served:
        assert served.url.startswith("http://127.0.0.1:")
        port = served.url.rsplit(":", 1)[1]
        env = {**served.env}
        env.pop("CORRAL_TOKEN")  # from the token file the server wrote
        ps = subprocess.run(
            [*CORRAL, "ps", "--json"], env=env, cwd=workspace, capture_output=True, timeout=60
        )
        assert (ps.returncode, json.loads(ps.stdout)) == (0, []), ps.stderr
        with http(served, served.token) as client:
            for host in (
                f"127.0.0.1:{port}",
                f"localhost:{port}",
                f"[::1]:{port}",
                f"10.1.2.3:{port}",  # an address of this machine the client used
                "corral.example.com",
                "corral.example.com:443",
                "Corral.Example.COM:8443",
            ):
                assert client.get("/v1/boxes", headers={"Host": host}).status_code == 200, host
            for host in ("attacker.example", f"attacker.example:{port}", "10.1.2.3:80"):
                assert client.get("/v1/boxes", headers={"Host": host}).status_code == 421, host
            proxied = {"Host": "corral.example.com"}
            for origin, status in (
                ("https://corral.example.com", 404),  # through the guard: no such box
                ("https://corral.example.com:8443", 404),
                ("http://corral.example.com", 404),
                ("https://attacker.example", 403),
                ("https://corral.example.com.attacker.example", 403),
                ("null", 403),
            ):
                r = client.post("/v1/boxes/box-nope/pause", headers={**proxied, "Origin": origin})
                assert r.status_code == status, (origin, r.text)
            r = client.post(
                "/v1/boxes/box-nope/pause",
                headers={"Host": f"127.0.0.1:{port}", "Origin": f"https://127.0.0.1:{port}"},
            )
            assert r.status_code == 404, r.text


def test_the_cli_finds_a_tcp_servers_token_file(tcp_server: Served, workspace: Path) -> None:
    env = {**tcp_server.env}
    env.pop("CORRAL_TOKEN")  # from the 0600 file the server wrote, as a user would
    r = subprocess.run(
        [*CORRAL, "ps", "--json"], env=env, cwd=workspace, capture_output=True, timeout=60
    )
    assert (r.returncode, json.loads(r.stdout)) == (0, [])


def test_every_refusal_is_a_code_and_a_sentence(tcp_server: Served) -> None:
    """Bad input from the outside: no route, a body too large whatever it claims to be, a
    number JSON cannot echo, bytes no program takes. Each a stable code, never a bare 500."""
    json_type = {"content-type": "application/json"}
    with http(tcp_server, tcp_server.token) as client:
        for r, status in ((client.get("/v1/nope"), 404), (client.patch("/v1/boxes"), 405)):
            assert (r.status_code, r.json()["error"]["code"]) == (status, "invalid_input")
        # FastAPI reads these routes' bodies whole whatever the Content-Type: capped too.
        r = client.post("/v1/boxes", content=b"x" * (2 << 20), headers={"content-type": "text/a"})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        box = client.post("/v1/boxes", json={}).json()["id"]
        try:
            run = f"/v1/boxes/{box}/run"
            for raw in (b'{"cmd": ["true"], "timeout": 1e999}', b'{"cmd": "true", "ttl": NaN}'):
                r = client.post(run, content=raw, headers=json_type)
                assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input"), r.text
            for bad in (
                {"cmd": ["a\0b"]},
                {"cmd": ["true"], "env": {"A=B": "c"}},
                {"cmd": ["true"], "env": {"A": "c\0"}},
                {"cmd": ["true"], "cwd": "a\0"},
            ):
                r = client.post(run, json=bad)
                assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input"), r.text
            for params in ({"env": "NO_VALUE"}, {"timeout": "inf"}):
                r = client.post(f"/v1/boxes/{box}/exec", params={"cmd": "true", **params})
                assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input"), r.text
            assert client.post(run, json={"cmd": "true"}).json()["exit_code"] == 0
        finally:
            client.delete(f"/v1/boxes/{box}")
    # A body declared too large is refused at once, not waited for.
    with raw_post(tcp_server, 99999999999, timeout=10) as sock:
        assert sock.recv(4096).split(b"\r\n")[0].endswith(b" 413 Request Entity Too Large")


async def test_websocket_refusals_say_why(tcp_server: Served, workspace: Path) -> None:
    """A refused handshake is the status and error body a plain request gets, and the SDK
    and the CLI raise or print it (no websockets traceback)."""
    from websockets.exceptions import InvalidStatus

    reader = "read-only-token-for-tests"
    async with corral.connect(tcp_server.url, tcp_server.token) as remote, remote.Sandbox() as sb:
        session = await sb.shell()
        base = tcp_server.url.replace("http://", "ws://", 1) + f"/v1/boxes/{sb.id}"
        for token, path, status, code in (
            (None, "/exec/ws?cmd=true", 401, "unauthorized"),
            (reader, "/exec/ws?cmd=true", 403, "access_denied"),
            (tcp_server.token, "/sessions/nope/attach", 404, "session_not_found"),
        ):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            with pytest.raises(InvalidStatus) as refused:
                async with websockets.asyncio.client.connect(
                    base + path, additional_headers=headers
                ):
                    pass
            assert refused.value.response.status_code == status
            assert json.loads(refused.value.response.body)["error"]["code"] == code
        async with corral.connect(tcp_server.url, reader) as observer:
            seen = observer.Sandbox()
            seen.id = sb.id
            with pytest.raises(corral.SandboxError) as caught:
                await seen.exec_stream(["cat"], stdin="pipe")
            assert caught.value.code == "access_denied"
        # An unknown signal is refused by the SDK, as in-process; the stream goes on.
        stream: Any = await sb.exec_stream(["cat"], stdin="pipe")
        with pytest.raises(corral.SandboxError, match="unknown signal"):
            await stream.signal("SIGNOPE")
        await stream.write(b"still-open")
        await stream.close_stdin()
        assert b"".join([getattr(e, "data", b"") async for e in stream]) == b"still-open"
        env = {**tcp_server.env, "CORRAL_TOKEN": reader}
        r = await asyncio.to_thread(
            subprocess.run,
            [*CORRAL, "attach", session.session_id],
            env=env,
            cwd=workspace,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
        )
        assert r.returncode != 0
        assert b"[access_denied]" in r.stderr
        assert b"Traceback" not in r.stderr


def test_cp_copies_directories_both_ways(server: Served, workspace: Path, tmp_path: Path) -> None:
    """``corral cp`` as with docker: a tree in and out (binary files byte for byte), into
    a directory that exists, ``-`` for stdin and stdout, links skipped and named, and a
    missing file named on either side without a traceback."""
    tree = tmp_path / "tree"
    (tree / "sub" / "deeper").mkdir(parents=True)
    blob = os.urandom(200_000)
    (tree / "sub" / "deeper" / "blob.bin").write_bytes(blob)
    (tree / "a.txt").write_text("a\n")
    (tree / "empty").mkdir()
    (tree / "link").symlink_to("/etc/passwd")
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()  # its workspace
    try:
        r = cli(server, "cp", str(tree), f"{box}:tree", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert b"skipped" in r.stderr and b"link" in r.stderr
        r = cli(server, "exec", box, "--", "sh", "-c", "cd tree && find . | sort", cwd=tmp_path)
        listed = r.stdout.decode().split()
        assert listed == [
            ".",
            "./a.txt",
            "./empty",
            "./sub",
            "./sub/deeper",
            "./sub/deeper/blob.bin",
        ]
        assert cli(server, "cp", str(tree / "a.txt"), f"{box}:tree", cwd=tmp_path).returncode == 0
        r = cli(server, "cp", "-", f"{box}:tree/from-stdin", cwd=tmp_path, stdin=b"\x00\xff")
        assert r.returncode == 0, r.stderr
        (tmp_path / "out").mkdir()
        r = cli(server, "cp", f"{box}:tree", str(tmp_path / "out"), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        back = tmp_path / "out" / "tree"
        assert (back / "sub" / "deeper" / "blob.bin").read_bytes() == blob
        assert (back / "from-stdin").read_bytes() == b"\x00\xff"
        assert (back / "a.txt").read_text() == "a\n"
        assert (back / "empty").is_dir()
        r = cli(server, "cp", f"{box}:tree/sub/deeper/blob.bin", "-", cwd=tmp_path)
        assert r.stdout == blob
        # named on its own, a link is refused, not skipped with success
        r = cli(server, "cp", str(tree / "link"), f"{box}:x", cwd=tmp_path)
        assert r.returncode == 2 and b"[invalid_input]" in r.stderr, r.stderr
        for args in (("nope", f"{box}:x"), (f"{box}:nope", "x")):
            r = cli(server, "cp", *args, cwd=tmp_path)
            assert r.returncode == 125
            assert b"[file_not_found]" in r.stderr, r.stderr
            assert b"Traceback" not in r.stderr
    finally:
        cli(server, "rm", box, cwd=tmp_path)


def test_cp_out_writes_through_no_link_the_box_planted(
    server: Served, workspace: Path, tmp_path: Path
) -> None:
    """The box shares this directory: a link it plants where DEST goes (a directory on
    the way, or DEST itself) is refused in one line, and nothing lands where it points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        plant = f"echo box > notes.txt; mkdir d2; echo evil > d2/f; ln -s {victim} sub; "
        plant += f"ln -s {victim} outdir; mkdir real; ln -s {victim} real/inner"
        r = cli(server, "exec", box, "--", "sh", "-c", plant, cwd=workspace)
        assert r.returncode == 0, r.stderr
        for src, dest in (
            ("notes.txt", "sub/copy.txt"),
            ("notes.txt", "outdir"),
            ("d2", "outdir"),
            ("d2", "sub/d2"),
            ("notes.txt", "real/inner/x"),
            ("notes.txt", str(workspace / "sub" / "abs.txt")),
        ):
            r = cli(server, "cp", f"{box}:{src}", dest, cwd=workspace)
            assert r.returncode == 125, (dest, r.stderr)
            assert b"[file_error]" in r.stderr and b"is a symbolic link" in r.stderr, r.stderr
            assert len(r.stderr.splitlines()) == 1, r.stderr
        assert list(victim.iterdir()) == []
        # real directories, named through .. too, still take copies
        r = cli(server, "cp", f"{box}:d2", "../../ws/real/d2", cwd=workspace / "real")
        assert r.returncode == 0, r.stderr
        assert (workspace / "real" / "d2" / "f").read_text() == "evil\n"
    finally:
        cli(server, "rm", box, cwd=tmp_path)


@pytest.mark.parametrize("where", ["server", "tcp_server"])
def test_a_refusal_while_the_body_is_sent_is_the_server_s_answer(
    where: str, request: pytest.FixtureRequest, workspace: Path, tmp_path: Path
) -> None:
    """A server refuses a request before reading all its body (a copy to a path the policy
    refuses, stdin over its cap) and closes: the send breaks, and the answer it sent is
    the error, not a retryable ``server_unavailable ... Broken pipe``."""
    served: Served = request.getfixturevalue(where)
    big = tmp_path / "big"
    big.write_bytes(b"\0" * (32 << 20))  # far more than the socket buffers hold
    box = cli(served, "create", cwd=workspace).stdout.decode().strip()
    try:
        r = cli(served, "cp", str(big), f"{box}:/etc/x", cwd=workspace)
        assert b"[path_outside_sandbox]" in r.stderr, r.stderr
        assert r.returncode == 2  # the caller's mistake, as a bad flag: not 125
        assert r.stderr.count(b"\n") == 1, r.stderr
        script = f'head -c {(256 << 20) + (1 << 20)} /dev/zero | "$@"'
        r = subprocess.run(
            ["sh", "-c", script, "sh", *CORRAL, "exec", "-i", box, "--", "wc", "-c"],
            env=served.env,
            cwd=workspace,
            capture_output=True,
            timeout=120,
        )
        assert r.returncode == 125 and b"[request_too_large]" in r.stderr, r.stderr
    finally:
        cli(served, "rm", box, cwd=workspace)


def test_cp_names_a_special_file_in_words(server: Served, workspace: Path) -> None:
    # The API's type "other" was printed as it is: "is a other", "(a other)".
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        r = cli(server, "exec", box, "--", "sh", "-c", "mkdir d && mkfifo ff d/ff", cwd=workspace)
        assert r.returncode == 0, r.stderr
        r = cli(server, "cp", f"{box}:ff", "x", cwd=workspace)
        assert r.returncode == 2 and b"ff is a special file (a FIFO" in r.stderr, r.stderr
        r = cli(server, "cp", f"{box}:d", "d-out", cwd=workspace)
        assert r.returncode == 0 and b"d/ff (a special file (a FIFO" in r.stderr, r.stderr
    finally:
        cli(server, "rm", box, cwd=workspace)


def test_cp_in_reads_through_no_link_the_box_planted(
    server: Served, workspace: Path, tmp_path: Path
) -> None:
    """Copying in names a host file, often in the box's own workspace: a directory link the
    box planted on the way (``sub -> /some/host/dir``) must not hand it a host file."""
    secret_dir = tmp_path / "host-secrets"
    (secret_dir / "alice-project" / ".ssh").mkdir(parents=True)
    (secret_dir / "key").write_text("host secret\n")
    names_only = tmp_path / "names-only"  # no file: the walk once made its tree in the box
    (names_only / "bob-taxes").mkdir(parents=True)
    box = cli(server, "create", cwd=workspace).stdout.decode().strip()
    try:
        plant = f"ln -s {secret_dir} sub && ln -s {names_only} names"
        r = cli(server, "exec", box, "--", "sh", "-c", plant, cwd=workspace)
        assert r.returncode == 0, r.stderr
        for src in ("sub/key", str(workspace / "sub" / "key"), "sub", "names"):
            r = cli(server, "cp", src, f"{box}:/tmp/got", cwd=workspace)
            assert r.returncode != 0 and b"is a symbolic link" in r.stderr, (src, r.stderr)
            r = cli(server, "exec", box, "--", "sh", "-c", "test ! -e /tmp/got", cwd=workspace)
            assert r.returncode == 0, f"{src}: something was made in the box"
        (workspace / "plain.txt").write_text("fine\n")  # a real file still goes in
        assert cli(server, "cp", "plain.txt", f"{box}:/tmp/plain", cwd=workspace).returncode == 0
        r = cli(server, "exec", box, "--", "cat", "/tmp/plain", cwd=workspace)
        assert r.stdout == b"fine\n"
    finally:
        cli(server, "rm", box, cwd=tmp_path)


# ---- lifecycle ---------------------------------------------------------------------------
def _wait_gone(client: httpx.Client, box: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/boxes/{box}").status_code != 404:
        assert time.monotonic() < deadline, f"{box} outlived its lease"
        time.sleep(0.05)  # polling the API: the reaper runs on the server's clock


def test_ttl_and_idle_timeout_reap_boxes(server: Served) -> None:
    with http(server) as client:
        ttl = client.post("/v1/boxes", json={"ttl_secs": 1}).json()["id"]
        idle = client.post("/v1/boxes", json={"idle_timeout_secs": 1}).json()["id"]
        busy = client.post("/v1/boxes", json={"idle_timeout_secs": 1}).json()["id"]
        client.post(f"/v1/boxes/{busy}/run", json={"cmd": "sleep 120", "background": True})
        _wait_gone(client, ttl)
        _wait_gone(client, idle)
        assert client.get(f"/v1/boxes/{busy}").status_code == 200  # its process runs
        client.delete(f"/v1/boxes/{busy}")


def test_a_shell_nobody_uses_does_not_keep_its_box(server: Served) -> None:
    """A session's shell at its prompt is not a running process to the idle timer: with
    nobody attached, writing or waiting on it, its box is idle. An ``expect`` that waits
    longer than the idle timeout keeps it (the agent is using the box)."""
    with http(server) as client:
        quiet, waited = (
            client.post("/v1/boxes", json={"idle_timeout_secs": 1}).json()["id"] for _ in (1, 2)
        )
        sessions = {
            box: client.post(f"/v1/boxes/{box}/sessions", json={}).json()["id"]
            for box in (quiet, waited)
        }
        expect = f"/v1/boxes/{waited}/sessions/{sessions[waited]}/expect"

        def wait_on_it() -> int:
            with http(server) as own:
                return own.post(expect, json={"pattern": "never", "timeout": 2.5}).status_code

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(wait_on_it)
            _wait_gone(client, quiet)
            assert waiting.result(timeout=30) not in (404, 410)  # its box was not reaped
        assert client.get(f"/v1/boxes/{waited}").status_code == 200
        _wait_gone(client, waited)  # and idle once nothing waits on it


def test_looking_at_a_box_does_not_keep_it_alive(server: Served) -> None:
    # A dashboard tab polls the selected box's processes every 2 s: that must not hold it.
    with http(server) as client:
        box = client.post("/v1/boxes", json={"idle_timeout_secs": 1}).json()["id"]
        looks = ("/processes", "/sessions", "/info", "/files?path=.", "/files/stat?path=.", "")
        deadline = time.monotonic() + 30
        while (r := client.get(f"/v1/boxes/{box}")).status_code != 404:
            assert r.status_code == 200 and time.monotonic() < deadline, "looks kept it alive"
            for look in looks:  # as fast as the server answers: far more often than 1 s
                client.get(f"/v1/boxes/{box}{look}")


def test_a_run_cut_by_its_box_s_lease_says_so(server: Served) -> None:
    with http(server) as client:
        box = client.post("/v1/boxes", json={"ttl_secs": 1}).json()["id"]
        r = client.post(f"/v1/boxes/{box}/run", json={"cmd": "sleep 60"}, timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (410, "sandbox_closed")
        assert "its ttl lease ended" in r.json()["error"]["message"]


def test_every_way_to_wait_for_a_command_says_its_box_s_lease_ended(server: Served) -> None:
    """A streamed command and a waited one, cut by their box's lease, end with the error
    (an error frame on a stream), not with the SIGTERM of the reaper as their own end."""
    from corral.client import frames

    with http(server) as client:
        box = client.post("/v1/boxes", json={"ttl_secs": 1}).json()["id"]
        started = client.post(
            f"/v1/boxes/{box}/run", json={"cmd": "sleep 60", "background": True}
        ).json()
        streamed = client.post(
            f"/v1/boxes/{box}/exec", params={"cmd": ["sh", "-c", "echo start; sleep 60"]}
        )
        kinds = dict(frames.split_frames(bytearray(streamed.content)))
        assert frames.END not in kinds, kinds
        assert json.loads(kinds[frames.ERROR])["error"]["code"] == "sandbox_closed", kinds
        assert kinds[frames.STDOUT] == b"start\n"
        box2 = client.post("/v1/boxes", json={"ttl_secs": 1}).json()["id"]
        started = client.post(
            f"/v1/boxes/{box2}/run", json={"cmd": "sleep 60", "background": True}
        ).json()
        r = client.post(f"/v1/boxes/{box2}/processes/{started['pid']}/wait", timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (410, "sandbox_closed"), r.text
        assert "its ttl lease ended" in r.json()["error"]["message"]
        # corral logs -f: the follow stream ends with the error too
        box3 = client.post("/v1/boxes", json={"ttl_secs": 1}).json()["id"]
        started = client.post(
            f"/v1/boxes/{box3}/run", json={"cmd": "sleep 60", "background": True}
        ).json()
        followed = client.get(f"/v1/boxes/{box3}/processes/{started['pid']}/follow", timeout=60)
        kinds = dict(frames.split_frames(bytearray(followed.content)))
        assert frames.END not in kinds, kinds
        assert json.loads(kinds[frames.ERROR])["error"]["code"] == "sandbox_closed", kinds


def test_a_command_whose_box_another_caller_deleted_says_so(server: Served) -> None:
    """``corral rm`` under a running ``corral exec``: the exec's end is the box's, not the
    command's own (it exited 143 without a word)."""
    from corral.client import frames

    with http(server) as client:
        box = client.post("/v1/boxes", json={}).json()["id"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:

            def stream() -> bytes:
                with http(server) as own:
                    params = {"cmd": ["sh", "-c", "echo started; sleep 60"]}
                    return own.post(f"/v1/boxes/{box}/exec", params=params, timeout=60).content

            streamed = pool.submit(stream)
            deadline = time.monotonic() + 30
            while not client.get(f"/v1/boxes/{box}/processes").json():
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.05)
            assert client.delete(f"/v1/boxes/{box}").status_code == 204
            kinds = dict(frames.split_frames(bytearray(streamed.result(60))))
    assert frames.END not in kinds, kinds
    error = json.loads(kinds[frames.ERROR])["error"]
    assert error["code"] == "sandbox_closed" and "was deleted" in error["message"], error


def test_a_stopping_server_ends_the_commands_in_flight_with_a_retryable_error(
    tmp_path: Path,
) -> None:
    """SIGTERM closes the boxes as the shutdown begins: a run in flight gets the JSON error
    ``server_unavailable`` (retryable), a stream its error frame, and nothing logs a
    traceback. (They were cancelled at the end of uvicorn's graceful window instead: a bare
    text 500, a stream that just stopped.)"""
    from corral.client import frames

    served = start(tmp_path / "run", "--socket", str(tmp_path / "s.sock"))
    try:
        with http(served) as client:
            box = client.post("/v1/boxes", json={}).json()["id"]

            def post(path: str, **kwargs: Any) -> httpx.Response:
                with http(served) as own:  # a connection of its own, closed after
                    return own.post(path, timeout=60, **kwargs)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                run = pool.submit(post, f"/v1/boxes/{box}/run", json={"cmd": "sleep 100"})
                stream = pool.submit(
                    post,
                    f"/v1/boxes/{box}/exec",
                    params={"cmd": ["sh", "-c", "echo tick; sleep 100"]},
                )
                deadline = time.monotonic() + 30
                while len(client.get(f"/v1/boxes/{box}/processes").json()) < 2:
                    assert time.monotonic() < deadline, "the two commands never started"
                    time.sleep(0.05)
                served.proc.send_signal(signal.SIGTERM)
                ran, streamed = run.result(60), stream.result(60)
        assert ran.status_code == 503, ran.text
        assert ran.json()["error"]["code"] == "server_unavailable"
        assert ran.json()["error"]["retryable"] is True
        kinds = dict(frames.split_frames(bytearray(streamed.content)))
        assert json.loads(kinds[frames.ERROR])["error"]["code"] == "server_unavailable", kinds
        assert served.proc.wait(60) == 0
        assert served.proc.stderr is not None
        log = served.proc.stderr.read().decode()
        assert "Traceback" not in log and "Cancel" not in log, log
    finally:
        served.stop()


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie waits for init to reap it: gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_a_killed_server_leaves_no_box_and_restarts_empty(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    sock = str(tmp_path / "s.sock")
    served = start(runtime, "--socket", sock)
    with http(served) as client:
        made = client.post("/v1/boxes", json={}).json()
        box, sandbox_id = made["id"], made["sandbox_id"]
        client.post(f"/v1/boxes/{box}/run", json={"cmd": "sleep 1000", "background": True})
    boxes = _descendants(served.proc.pid)
    assert boxes, "the box's processes are the server's descendants"
    try:
        for where, said in (
            (sock, b"already listens"),
            (f"{tmp_path}/no/s.sock", b"cannot listen"),
        ):
            # Not a second server on the live one's socket (its boxes would be out of reach).
            second = subprocess.run(
                [*CORRAL, "serve", "--socket", where], capture_output=True, timeout=60
            )
            assert second.returncode == 2, second.stderr
            assert said in second.stderr
            assert b"Traceback" not in second.stderr
        with http(served) as client:
            assert client.get(f"/v1/boxes/{box}").status_code == 200  # still the first's
    finally:  # (on a failure above too: never leave the first server running)
        served.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive := _alive(boxes):
        assert time.monotonic() < deadline, f"box processes outlived the server: {alive}"
        time.sleep(0.05)
    again = start(runtime, "--socket", sock)
    try:
        with http(again) as client:
            assert client.get("/v1/boxes").json() == []
            assert client.post("/v1/boxes/x/run", json={"cmd": "true"}).status_code == 404
            # The first start sweeps what the killed server's box left on the host.
            client.post("/v1/boxes", json={})
        assert not (state_root() / "boxes" / sandbox_id).exists()
        assert sandbox_id not in Path("/proc/self/mountinfo").read_text()
    finally:
        assert again.stop() == 0


def test_a_server_killed_mid_stream_is_not_said_as_a_cut_head(
    tmp_path: Path, workspace: Path
) -> None:
    # The head and output had long arrived; the message said "ended in its head".
    served = start(tmp_path / "run", "--socket", str(tmp_path / "s.sock"))
    try:
        proc = subprocess.Popen(
            [*CORRAL, "run", "--", "sh", "-c", "echo started; sleep 60"],
            env=served.env,
            cwd=workspace,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == b"started\n"
    finally:
        served.stop(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 125, err
    assert b"[server_unavailable]" in err and b"mid-stream" in err and b"head" not in err, err


def test_a_paused_box_dies_with_a_killed_server(tmp_path: Path) -> None:
    """A frozen process acts on no signal until thawed: the kills that end a box with its
    server stayed pending, and a paused box's processes lived on, frozen, until a later
    start swept them. A guard outside the box thaws it once the server is gone."""
    served = start(tmp_path / "run", "--socket", str(tmp_path / "s.sock"))
    try:
        with http(served) as client:
            box = client.post("/v1/boxes", json={}).json()["id"]
            client.post(f"/v1/boxes/{box}/run", json={"cmd": "sleep 1000", "background": True})
            assert client.post(f"/v1/boxes/{box}/pause").status_code == 200
            assert client.get(f"/v1/boxes/{box}").json()["state"] == "paused"
        boxes = _descendants(served.proc.pid)
        assert boxes, "the box's processes are the server's descendants"
    finally:
        served.stop(signal.SIGKILL)
    # Within seconds (a later start's orphan sweep would end them too, but only when some
    # corral process starts a box: none does here).
    deadline = time.monotonic() + 10
    while alive := _alive(boxes):
        assert time.monotonic() < deadline, f"a paused box outlived the server: {alive}"
        time.sleep(0.05)


async def test_a_tcp_server_restarted_at_its_address_keeps_its_token(tmp_path: Path) -> None:
    """The clients of a server that was killed go on with the restarted one: the same token
    (from its 0600 file), and their boxes are gone (reaped), not 'unauthorized'."""
    runtime = tmp_path / "run"
    first = await asyncio.to_thread(start, runtime, "--listen", "127.0.0.1:0")
    port = first.url.rsplit(":", 1)[1]
    async with corral.connect(first.url, first.token) as remote:
        box = await remote.Sandbox().__aenter__()
        await asyncio.to_thread(first.stop, signal.SIGKILL)
        with pytest.raises(corral.ServerUnavailable):
            await box.run("true")
        again = await asyncio.to_thread(start, runtime, "--listen", f"127.0.0.1:{port}")
        try:
            assert again.token == first.token
            assert await remote.boxes() == []
            with pytest.raises(corral.BoxNotFound):
                await box.run("true")
        finally:
            assert await asyncio.to_thread(again.stop) == 0


def test_sigterm_closes_every_box(tmp_path: Path) -> None:
    served = start(tmp_path / "run", "--socket", str(tmp_path / "s.sock"))
    with http(served) as client:
        client.post("/v1/boxes", json={})
    boxes = _descendants(served.proc.pid)
    assert served.stop() == 0
    assert not _alive(boxes)
    assert not Path(tmp_path / "s.sock").exists()


# ---- a person on an agent's terminal ------------------------------------------------------
async def test_a_person_answers_an_agents_prompt_over_a_websocket(server: Served) -> None:
    async with corral.connect(server.url) as remote, remote.Sandbox() as sb:
        session = await sb.shell()
        await session.write("read -p 'Continue? ' a; echo got-$a\n")
        assert (await session.expect("Continue\\? $"))["matched"]
        path = f"/v1/boxes/{sb.id}/sessions/{session.session_id}/attach"
        async with websockets.asyncio.client.unix_connect(
            server.socket, f"ws://localhost{path}"
        ) as ws:
            screen = await ws.recv()
            assert b"Continue?" in screen  # the person sees what the agent saw
            # Control messages it cannot take are ignored, the terminal kept (1e400 is an
            # infinity, which no int takes: it cut the connection with a traceback).
            for bad in ('{"resize": [1e400, 30]}', '{"resize": ["x", 2]}', "{", "[]"):
                await ws.send(bad)
            await ws.send(b"yes\r")
            assert (await session.expect("got-yes"))["matched"]
        await session.write("echo still-here\n")  # detached: the session goes on
        assert (await session.expect("still-here"))["matched"]


# ---- metrics and the API's document --------------------------------------------------------
def test_metrics_and_the_checked_in_openapi(server: Served) -> None:
    with http(server) as client:
        text = client.get("/metrics").text
        for name in (
            "corral_boxes",
            "corral_box_starts_total",
            "corral_box_start_seconds",
            "corral_pool_hits_total",
            "corral_oom_kills_total",
            "corral_command_timeouts_total",
            "corral_proxy_refusals_total",
        ):
            assert name in text
        served_doc = client.get("/openapi.json").json()
    assert served_doc == json.loads(DOCS_OPENAPI.read_text()), (
        "docs/openapi.json is stale: python -m corral.server.openapi > docs/openapi.json"
    )


async def test_metrics_are_live(server: Served) -> None:
    """Boxes by their state; a held box's OOM kills and network refusals counted while it
    lives (not once it is deleted); commands over the exec WebSocket counted too."""
    paused, oom, refused, timeouts = (
        'corral_boxes{state="paused"}',
        "corral_oom_kills_total",
        "corral_proxy_refusals_total",
        "corral_command_timeouts_total",
    )
    piped = 'corral_commands_total{ended="timed_out"}'
    running = 'corral_boxes{state="running"}'
    before = {name: metric(server, name) for name in (oom, refused, timeouts, piped, running)}
    policy = corral.Policy.model_validate(
        {
            "limits": {"memory_bytes": 64 << 20},
            "network": {"mode": "allowlist", "allow_hosts": ["pypi.org"]},
        }
    )
    async with corral.connect(server.url) as remote:
        sb = remote.Sandbox(policy=policy)
        async with sb:
            hog = await sb.run(["python3", "-c", "x = bytearray(300 << 20)"])
            assert hog.ended == "oom_killed"
            probe = "import urllib.request as u; u.urlopen('http://example.com', timeout=5)"
            assert (await sb.run(["python3", "-c", probe])).exit_code != 0
            assert metric(server, oom) == before[oom] + 1
            assert metric(server, refused) == before[refused] + 1
            assert metric(server, running) == before[running] + 1
            with http(server) as client:
                assert client.post(f"/v1/boxes/{sb.id}/pause").status_code == 200
                assert (metric(server, paused), metric(server, running)) == (1, before[running])
                assert client.post(f"/v1/boxes/{sb.id}/resume").status_code == 200
            stream: Any = await sb.exec_stream(["sleep", "30"], stdin="pipe", timeout=0.5)
            assert [e async for e in stream][-1] == Exited(-15)
            assert metric(server, timeouts) == before[timeouts] + 1
            assert metric(server, piped) == before[piped] + 1
        assert metric(server, oom) == before[oom] + 1  # counted once, not again at the delete
        assert metric(server, refused) == before[refused] + 1
        assert metric(server, paused) == 0


def test_responses_are_counted_by_status_class(server: Served, workspace: Path) -> None:
    client_errors = 'corral_http_requests_total{status="4xx"}'
    answered = 'corral_http_requests_total{status="2xx"}'
    errors_before, answered_before = metric(server, client_errors), metric(server, answered)
    with http(server) as client:
        assert client.get("/v1/no-such-route").status_code == 404
    r = cli(server, "run", "--", "echo", "hi", cwd=workspace)  # a streamed response
    assert (r.returncode, r.stdout) == (0, b"hi\n"), r.stderr
    assert metric(server, client_errors) == errors_before + 1
    # The run's and the two earlier reads of /metrics (each counted once its head is sent).
    assert metric(server, answered) == answered_before + 3


# ---- corral shell, attach and sessions through the server ------------------------------------
class _Terminal:
    """A command on a pseudo-terminal of its own, read with bounded waits."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True
        )
        os.close(slave)
        self.seen = bytearray()

    def expect(self, text: bytes, timeout: float = 60.0) -> None:
        import select

        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never came: {bytes(self.seen)[-500:]!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                assert chunk, f"the terminal closed before {text!r}: {bytes(self.seen)!r}"
                self.seen += chunk

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            os.close(self.master)


def test_bad_detach_keys_through_the_server_are_one_line(server: Served, workspace: Path) -> None:
    # The parser's library error once reached the user as a traceback (exit 1).
    for args in (("shell", "--detach-keys", "bogus"), ("attach", "x", "--detach-keys=ctrl-1")):
        r = cli(server, *args, cwd=workspace)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(b"corral: [invalid_input] invalid detach keys"), r.stderr
        assert r.stderr.count(b"\n") == 1, r.stderr


def test_sessions_and_attach_through_the_server_refuse_what_they_do_not_take(
    server: Served, workspace: Path
) -> None:
    # `corral sessions --bogus` and `corral sessions extra` were run as `corral sessions`.
    for args in (("sessions", "--bogus"), ("sessions", "extra"), ("attach", "x", "--bogus")):
        r = cli(server, *args, cwd=workspace)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(b"corral: [invalid_input] ") and args[-1].encode() in r.stderr
    r = cli(server, "sessions", "--json", cwd=workspace)
    assert r.returncode == 0 and isinstance(json.loads(r.stdout), list), r.stderr


def test_shell_through_the_server_ends_its_box(server: Served, workspace: Path) -> None:
    term = _Terminal([*CORRAL, "shell", "--shell", "/bin/sh"], server.env, workspace)
    term.expect(b"exit ends it")
    term.type(b"echo sum-$((2+3))\r")
    term.expect(b"sum-5")
    with http(server) as client:
        held = [b["id"] for b in client.get("/v1/boxes").json() if b["labels"].get("via")]
        assert len(held) == 1  # the shell's box is on the server
        term.type(b"exit 4\r")
        assert term.wait() == 4
        assert client.get(f"/v1/boxes/{held[0]}").status_code == 404  # removed with its shell


def _raw(fd: int) -> bool:
    """Whether the terminal of ``fd`` is left without line editing (canonical mode off)."""
    import termios

    return not termios.tcgetattr(fd)[3] & termios.ICANON


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_shell_through_the_server_killed_restores_the_terminal_and_ends_its_box(
    server: Served, workspace: Path, sig: int
) -> None:
    """As in-process: SIGTERM or SIGHUP of ``corral shell`` restores the terminal (it was
    left raw, without echo) and removes the box it made (it lived on the server for good)."""
    term = _Terminal([*CORRAL, "shell", "--shell", "/bin/sh"], server.env, workspace)
    term.expect(b"exit ends it")
    term.type(b"echo sum-$((2+3))\r")
    term.expect(b"sum-5")
    assert _raw(term.master)
    with http(server) as client:
        held = [b["id"] for b in client.get("/v1/boxes").json() if b["labels"].get("via")]
        assert len(held) == 1
        term.proc.send_signal(sig)
        term.expect(b"closing box")
        assert not _raw(term.master)  # restored before the CLI exits
        assert term.wait() == 128 + sig
        assert client.get(f"/v1/boxes/{held[0]}").status_code == 404


async def test_attach_to_a_box_removed_underneath_says_so(server: Served, workspace: Path) -> None:
    """The box closed under a person's attach (corral rm, its lease): said, exit 129 (it
    ended silently with 1); SIGTERM of an attach restores the terminal, the session runs on."""
    async with corral.connect(server.url) as remote:
        sb = await remote.Sandbox().__aenter__()
        session = await sb.shell()
        term = _Terminal([*CORRAL, "attach", session.session_id[:8]], server.env, workspace)
        term.type(b"echo $((40+2))\r")
        await asyncio.to_thread(term.expect, b"42")  # the box's answer: the bridge is up
        term.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(term.expect, b"detached; session")
        assert not _raw(term.master)
        assert await asyncio.to_thread(term.wait) == 128 + signal.SIGTERM
        term = _Terminal([*CORRAL, "attach", session.session_id[:8]], server.env, workspace)
        term.type(b"echo $((50+5))\r")
        await asyncio.to_thread(term.expect, b"55")
        await sb.__aexit__(None, None, None)  # the box is removed under the person
        await asyncio.to_thread(term.expect, b"was closed")
        assert await asyncio.to_thread(term.wait) == 129


async def test_attach_through_the_server_and_detach(server: Served, workspace: Path) -> None:
    async with corral.connect(server.url) as remote, remote.Sandbox() as sb:
        session = await sb.shell()
        r = cli(server, "sessions", "--json", cwd=workspace)
        assert session.session_id in [s["id"] for s in json.loads(r.stdout)]
        term = _Terminal([*CORRAL, "attach", session.session_id[:8]], server.env, workspace)
        term.type(b"echo typed-by-a-person\r")
        assert (await session.expect("typed-by-a-person"))["matched"]
        term.expect(b"typed-by-a-person")
        term.type(b"\x1d")  # ctrl-]: detach
        await asyncio.to_thread(term.expect, b"detached from session")
        assert await asyncio.to_thread(term.wait) == 0
        await session.write("echo after-detach\n")
        assert (await session.expect("after-detach"))["matched"]


def test_slow_and_silent_clients_do_not_starve_others(tcp_server: Served) -> None:
    host, port = tcp_server.url.removeprefix("http://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(50)]
    try:
        for sock in silent[:25]:
            sock.sendall(b"GET /v1/boxes HTTP/1.1\r\nHost: ")  # a head that never ends
        with http(tcp_server, tcp_server.token) as client:
            for _ in range(5):
                assert client.get("/v1/boxes").status_code == 200
        # More than the connection cap, each trickling a small body (read whole, capped):
        # they are evicted as idle ones are, and a real client still gets in.
        silent.extend(raw_post(tcp_server, 100) for _ in range(280))
        with http(tcp_server, tcp_server.token) as client:
            assert client.get("/v1/boxes").status_code == 200
    finally:
        for sock in silent:
            sock.close()


def test_a_box_whose_agent_died_says_so(server: Served) -> None:
    with http(server) as client:
        made = client.post("/v1/boxes", json={}).json()
        marker = f'"sandbox_id":"{made["sandbox_id"]}"'.encode()
        agents = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit()
            and _cmdline(p).startswith(b"/usr/bin/python3")
            and marker in _cmdline(p)
        ]
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGKILL)  # the box dies under the server
        deadline = time.monotonic() + 30
        while (box := client.get(f"/v1/boxes/{made['id']}").json())["state"] != "broken":
            assert time.monotonic() < deadline, box
            time.sleep(0.05)  # polling the API: the server learns it from the channel
        assert "guest agent" in box["broken"]
        # bwrap ended with its agent: reaped by then, not a zombie of the server until delete
        while zombies := _zombie_children(server.proc.pid):
            assert time.monotonic() < deadline, zombies
            time.sleep(0.05)
        r = client.post(f"/v1/boxes/{made['id']}/run", json={"cmd": "true"})
        assert r.json()["error"]["code"] == "sandbox_broken"
        assert client.delete(f"/v1/boxes/{made['id']}").status_code == 204


def _zombie_children(pid: int) -> list[str]:
    """The children of ``pid`` that exited and were not reaped, as ``PID (NAME)``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == pid:
            found.append(stat.split(")", 1)[0] + ")")
    return found


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


async def test_a_preview_url_over_a_unix_socket_is_its_path(server: Served) -> None:
    async with corral.connect(server.url) as remote, remote.Sandbox() as sb:
        exposed = await sb.expose(8000)
        assert exposed.preview_url == f"/v1/boxes/{sb.id}/ports/8000/"


async def test_a_pool_size_below_one_is_refused_remotely_too(server: Served) -> None:
    async with corral.connect(server.url) as remote:
        for bad in (0, -1, True):
            with pytest.raises(corral.SandboxError, match="pool size must be at least 1"):
                remote.SandboxPool(size=bad)


def test_a_create_with_cli_argv_and_a_policy_is_refused(server: Served) -> None:
    with http(server) as client:
        r = client.post("/v1/boxes", json={"cli_argv": ["--memory", "64M"], "policy": {}})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input")
        assert "not both" in r.json()["error"]["message"]
        r = client.post("/v1/boxes", json={"cli_argv": ["--help"]})  # not printed in its log
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_input")
        assert "corral run --help" in r.json()["error"]["message"]


async def test_a_websocket_to_no_route_gets_the_json_404(server: Served) -> None:
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as refused:
        async with websockets.asyncio.client.unix_connect(server.socket, "ws://localhost/v1/nope"):
            pass
    assert refused.value.response.status_code == 404
    error = json.loads(refused.value.response.body)["error"]
    assert error["code"] == "invalid_input"
    assert "no such WebSocket route: /v1/nope" in error["message"]


async def test_a_websocket_that_vanishes_leaves_the_session_working(server: Served) -> None:
    async with corral.connect(server.url) as remote, remote.Sandbox() as sb:
        session = await sb.shell()
        path = f"/v1/boxes/{sb.id}/sessions/{session.session_id}/attach"
        ws = await websockets.asyncio.client.unix_connect(server.socket, f"ws://localhost{path}")
        await ws.send(b"echo before-vanishing\r")
        assert (await session.expect("before-vanishing"))["matched"]
        ws.transport.abort()  # no close frame: the browser tab crashed
        await session.write("echo after-vanishing\n")
        assert (await session.expect("after-vanishing"))["matched"]
        assert (await sb.run("echo the box too")).stdout == "the box too\n"
        described = await sb.describe()
        assert described["state"] == "running"


async def test_an_exec_websocket_that_closes_ends_its_silent_command(server: Served) -> None:
    # The command prints nothing: only the socket's end can tell it to stop.
    async with corral.connect(server.url) as remote, remote.Sandbox() as sb:
        path = f"/v1/boxes/{sb.id}/exec/ws?cmd=sleep&cmd=300"
        for vanish in (False, True):
            ws = await websockets.asyncio.client.unix_connect(
                server.socket, f"ws://localhost{path}"
            )
            (running,) = [p.pid for p in await sb.processes() if p.status == "running"]
            if vanish:
                ws.transport.abort()  # no close frame
            else:
                await ws.close()
            waited = await (await sb.process(running)).wait(30)
            assert (waited.status, waited.exit_code) == ("exited", -15), waited


def test_errors_say_whether_a_retry_may_help() -> None:
    assert corral.ServerBusy("busy").retryable
    assert corral.SandboxBroken("the box died").retryable
    assert not corral.PolicyError("bad field").retryable
    assert not corral.FileNotFound("no such file").retryable
    assert corral.errors.from_code("server_unavailable", "restarting").retryable


async def test_a_stdin_write_larger_than_a_message_local_and_remote(make_box: Any) -> None:
    # One message to the box (or one WebSocket message to the server) holds 16 MiB: a write
    # is sent in pieces, so any size arrives whole (it was RequestTooLarge in-process and a
    # raw websockets exception remotely).
    size = 17 << 20
    async with make_box() as sb:
        stream = await sb.exec_stream(["wc", "-c"], stdin="pipe")
        await stream.write(b"x" * size)
        await stream.close_stdin()
        events = [event async for event in stream]
        assert events == [Stdout(f"{size}\n".encode()), Exited(0)]


async def test_exec_stream_with_stdin_open_local_and_remote(make_box: Any) -> None:
    """Full duplex: an answer comes back while stdin is still open (the WebSocket path)."""
    upper = "import sys\nfor line in sys.stdin:\n    print(line.upper(), end='', flush=True)\n"
    async with make_box() as sb:
        stream = await sb.exec_stream(["python3", "-c", upper], stdin="pipe")
        events = aiter(stream)
        await stream.write(b"first\n")
        got = b""
        while b"FIRST\n" not in got:
            event = await asyncio.wait_for(anext(events), 30)
            got += getattr(event, "data", b"")
        await stream.write("second\n")
        await stream.close_stdin()
        rest = [e async for e in events]
        assert b"".join(getattr(e, "data", b"") for e in rest) == b"SECOND\n"
        assert type(rest[-1]).__name__ == "Exited"
        assert rest[-1].code == 0


def test_start_budget_and_box_cap_refuse_with_a_retryable_error(tmp_path: Path) -> None:
    with serving(
        tmp_path / "run", "--socket", str(tmp_path / "s.sock"), "--start-timeout", "0.001"
    ) as hurried:
        before = _descendants(hurried.proc.pid)
        with http(hurried) as client:
            r = client.post("/v1/boxes", json={})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "server_busy"
            assert r.json()["error"]["retryable"] is True
            assert client.get("/v1/boxes").json() == []
        deadline = time.monotonic() + 30
        while _alive(_descendants(hurried.proc.pid) - before):  # the cut start is torn down
            assert time.monotonic() < deadline, "a box over its start budget was left running"
            time.sleep(0.05)
    with (
        serving(
            tmp_path / "run2", "--socket", str(tmp_path / "s2.sock"), "--max-boxes", "1"
        ) as capped,
        http(capped) as client,
    ):
        first = client.post("/v1/boxes", json={})
        assert first.status_code == 201
        r = client.post("/v1/boxes", json={})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "server_busy")
        assert "--max-boxes" in r.json()["error"]["message"]
        client.delete(f"/v1/boxes/{first.json()['id']}")

        def create(_: int) -> int:  # at once: each passes the cap before any is held
            with http(capped) as own:
                return own.post("/v1/boxes", json={}).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert sorted(pool.map(create, range(4))) == [201, 503, 503, 503]
        assert len(client.get("/v1/boxes").json()) == 1


def test_one_shots_count_against_the_box_cap(tmp_path: Path) -> None:
    """``--max-boxes`` bounds the boxes of ``/v1/pools/run`` (and so ``corral run``) too:
    past it a one-shot waits its turn (never more running at once than the cap), and gets
    ``server_busy`` when no room comes within the start budget."""
    with (
        serving(
            tmp_path / "run",
            "--socket",
            str(tmp_path / "s.sock"),
            "--max-boxes",
            "2",
            "--start-timeout",
            "2",
        ) as capped,
        http(capped) as client,
    ):
        timed = {"cmd": "date +%s.%N; sleep 0.4; date +%s.%N"}

        def one_shot(_: int) -> tuple[float, float]:
            with http(capped) as own:
                r = own.post("/v1/pools/run", json=timed, timeout=60)
            assert r.status_code == 200, r.text
            began, ended = r.json()["stdout"].split()
            return float(began), float(ended)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            spans = list(pool.map(one_shot, range(4)))
        at_once = max(sum(b <= t < e for b, e in spans) for t, _ in spans)
        assert at_once <= 2, spans
        deadline = time.monotonic() + 30
        while metric(capped, "corral_one_shots ") > 0:  # their boxes close after the answer
            assert time.monotonic() < deadline, "one-shot boxes were never closed"
            time.sleep(0.05)
        held = [client.post("/v1/boxes", json={}) for _ in range(2)]
        assert [r.status_code for r in held] == [201, 201]
        began = time.monotonic()
        r = client.post("/v1/pools/run", json={"cmd": "true"}, timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "server_busy"), r.text
        assert "--max-boxes" in r.json()["error"]["message"]
        assert time.monotonic() - began >= 2  # it waited its start budget for room
        for box in held:
            client.delete(f"/v1/boxes/{box.json()['id']}")


def test_another_users_socket_is_named_as_such(tmp_path: Path) -> None:
    """A server serves its owner only (the peer uid check drops anyone else): a client
    of another uid is told so, not left with 'connection reset'."""
    from corral.client.fast import Conn

    path = tmp_path / "theirs.sock"
    path.touch()
    os.chown(path, 4242, 4242)
    error = Conn(f"unix:{path}")._broke_off(ConnectionResetError(104, "reset"))
    assert error.code == "unauthorized"
    assert "uid 4242" in error.message


def test_host_paths_in_flags_are_made_absolute_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server has its own directory: what the flags name on this host is resolved here."""
    from corral.client.cli import localize

    (tmp_path / "layout").mkdir()
    (tmp_path / "p.toml").touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKEN_HERE", "v1")
    got = localize(
        [
            "--image",
            "layout",
            "--policy",
            "p.toml",
            "-v",
            "data:/data",
            "-e",
            "TOKEN_HERE",
            "--",
            "ls",
            "--image",
            "x",
        ]
    )
    assert got == [
        "--workspace", str(tmp_path), "--image", str(tmp_path / "layout"),
        "--policy", str(tmp_path / "p.toml"), "-v", f"{tmp_path}/data:/data",
        "-e", "TOKEN_HERE=v1", "--", "ls", "--image", "x",
    ]  # fmt: skip
    assert localize(["--image", "python:3.12", "--", "true"])[2:4] == ["--image", "python:3.12"]


def test_a_trickled_body_gets_the_408_over_a_real_connection(tcp_server: Served) -> None:
    # The connection's head timer (10 s from connect) closed it without a word before the
    # body's own timeout (10 s from the head) could answer.
    with raw_post(tcp_server, 100, timeout=30) as sock:
        sock.settimeout(1.0)
        answer = b""
        deadline = time.monotonic() + 30
        while b"\r\n\r\n" not in answer:
            assert time.monotonic() < deadline, answer
            try:
                chunk = sock.recv(4096)  # a byte a second meanwhile: slow, not silent
            except TimeoutError:
                sock.sendall(b" ")
                continue
            assert chunk, f"closed without an answer after {answer!r}"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_a_body_that_trickles_is_cut_off() -> None:
    """A client sending a small body a byte at a time must not hold a connection (and a
    share of the connection cap) for ever: past the body timeout it gets 408."""
    from corral.server.auth import Access, Guard

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app saw a request whose body never came")

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b" ", "more_body": True}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    guard = Guard(app, Access(unix_owner=True, body_timeout=0.3))
    scope = {"type": "http", "method": "POST", "path": "/v1/boxes", "headers": []}
    async with asyncio.timeout(10):
        await guard(scope, receive, send)
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "timeout"


async def test_a_bug_answers_500_and_keeps_the_connection() -> None:
    """An exception no handler takes answers with the stable error body, the traceback goes
    to the log, and the client's kept-alive connection serves its next request (Starlette's
    own last-resort handler re-raised, and uvicorn closed the connection after every 500)."""
    import uvicorn

    from corral.cli.run import parse_run_args
    from corral.server.api import build_api
    from corral.server.boxes import Boxes, ServeLimits
    from corral.server.metrics import Metrics
    from corral.server.transport import http_server_config

    metrics = Metrics()
    app = build_api(Boxes(ServeLimits(), metrics), metrics, info={}, parse_run=parse_run_args)

    async def broken() -> None:
        raise RuntimeError("a bug for the test")

    app.add_api_route("/v1/broken", broken)
    listening = socket.create_server(("127.0.0.1", 0))  # connects queue until it serves
    port = listening.getsockname()[1]
    server = uvicorn.Server(http_server_config(app, port=port))
    serving_task = asyncio.create_task(server.serve(sockets=[listening]))
    try:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = []
            for path in ("/v1/broken", "/v1/health"):
                writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                answers.append((head.split(b" ")[1], json.loads(await reader.readexactly(length))))
            writer.close()
        assert answers[0][0] == b"500", answers
        assert answers[0][1]["error"]["code"] == "internal_error"
        assert (
            "GET /v1/broken (RuntimeError: a bug for the test)" in answers[0][1]["error"]["message"]
        )
        assert answers[1][0] == b"200", answers
    finally:
        server.should_exit = True
        await serving_task
        listening.close()


def test_a_client_leaving_mid_upload_is_no_server_failure(tmp_path: Path) -> None:
    """Ctrl-C during a ``corral exec -i`` upload: the server logged it as its own failure,
    with a traceback (starlette's ClientDisconnect)."""
    served = start(tmp_path / "run", "--listen", "127.0.0.1:0")
    try:
        with http(served, served.token) as client:
            box = client.post("/v1/boxes", json={}).json()["id"]
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = f"POST /v1/boxes/{box}/exec?cmd=cat&stdin=true HTTP/1.1\r\nHost: {host}:{port}"
            head += f"\r\nAuthorization: Bearer {served.token}\r\nContent-Length: 100000\r\n\r\n"
            sock.sendall(head.encode() + b"x" * 1000)  # then gone, the body a tenth sent
        with http(served, served.token) as client:  # the server goes on, the box too
            assert client.post(f"/v1/boxes/{box}/run", json={"cmd": "true"}).status_code == 200
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
        assert served.proc.stderr is not None
        log = served.proc.stderr.read().decode()
        assert "Traceback" not in log and "failed on" not in log, log
    finally:
        served.stop()


def test_a_full_stdout_through_the_server_is_said_as_in_process(
    server: Served, workspace: Path
) -> None:
    """``corral run ... > /dev/full``: this host's stdout refused the output, which is not the
    server failing (it was ``[server_unavailable]``, 125): one line, 120, as in-process."""
    with open("/dev/full", "wb") as full:
        r = subprocess.run(
            [*CORRAL, "run", "--", "echo", "hi"],
            env=server.env,
            cwd=workspace,
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    assert r.returncode == 120, r.stderr
    assert (
        r.stderr.decode()
        .strip()
        .endswith("corral: cannot write the output: No space left on device")
    )
    assert b"server_unavailable" not in r.stderr
