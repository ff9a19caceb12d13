"""Files a box leaves (issue 13, class 2) against the host-side readers of ``corral serve``:
its files API (the remote SDK, plain HTTP) and ``corral cp`` through it. A FIFO, a socket
or a link to a host file in the workspace must neither hang them nor hand out host data."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import corral
from corral.errors import FileOpError
from served import CORRAL, Served, serving

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

BOUND = 30  # seconds: a refusal is immediate; only a hang reaches this

SETUP = (
    "mkfifo pipe && python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""
    " && ln -s /etc/shadow shadow && ln -s /proc/1/environ environ && echo ok"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    runtime = tmp_path_factory.mktemp("run")
    with serving(runtime, "--socket", str(runtime / "s.sock")) as served:
        yield served


def _cp(served: Served, *args: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*CORRAL, "cp", *args], env=served.env, cwd=cwd, capture_output=True, timeout=BOUND
    )


async def test_special_files_through_the_servers_files_api_and_corral_cp(
    server: Served, workspace: Path, tmp_path: Path
) -> None:
    async with corral.connect(server.url) as remote, remote.Sandbox(workspace=workspace) as sb:
        r = await sb.run(["sh", "-c", SETUP])
        assert "ok" in r.stdout, r.stderr
        for name in ("pipe", "sock", "shadow", "environ"):
            with pytest.raises(FileOpError):
                await asyncio.wait_for(sb.files.read(f"/workspace/{name}"), BOUND)
        for name in ("pipe", "sock"):
            with pytest.raises(FileOpError):
                await asyncio.wait_for(sb.files.write(f"/workspace/{name}", b"x"), BOUND)
        async with httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=server.socket), base_url="http://localhost"
        ) as client:
            got = await client.get(
                f"/v1/boxes/{sb.id}/files/content", params={"path": "/workspace/pipe"}
            )
            assert got.status_code >= 400, got.text
        (tmp_path / "in.txt").write_text("x\n")
        for name in ("pipe", "sock", "shadow"):
            out = tmp_path / f"out-{name}"
            done = _cp(server, f"{sb.id}:{name}", str(out), cwd=tmp_path)
            assert done.returncode != 0, (name, done.stdout, done.stderr)
            assert b"Traceback" not in done.stderr, done.stderr
            assert not out.exists() or b"root:" not in out.read_bytes()
        for name in ("pipe", "sock"):
            done = _cp(server, str(tmp_path / "in.txt"), f"{sb.id}:{name}", cwd=tmp_path)
            assert done.returncode != 0, (name, done.stdout, done.stderr)
        assert (await sb.run("true")).exit_code == 0  # the box and its agent serve on
    assert (workspace / "pipe").is_fifo()
