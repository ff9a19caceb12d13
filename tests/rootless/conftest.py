"""The rootless slice: real boxes of an ordinary user. As root every test here is skipped;
tests/test_rootless.py runs this folder as the test users ``make setup`` creates
(``corral-rootless`` with subordinate ids, ``corral-nosubid`` without)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from corral.backends.host import subids


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    why = None
    if os.geteuid() == 0:
        why = "runs as an unprivileged user (tests/test_rootless.py switches to one)"
    elif shutil.which("bwrap") is None:
        why = "bubblewrap is not installed (apt-get install bubblewrap)"
    elif subids.userns_problem() is not None:
        why = subids.userns_problem()
    if why is not None:
        here = Path(__file__).parent
        for item in items:  # the hook sees the whole session's items: only this folder's
            if item.path.is_relative_to(here):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def mapped() -> bool:
    """Whether this user has subordinate ids (commands get an id of their own)."""
    return subids.probe().mapped


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
async def box(workspace: Path) -> AsyncIterator[Sandbox]:
    async with Sandbox(Policy(), workspace=workspace) as sb:
        yield sb


@pytest.fixture
async def host_server() -> Any:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        body = b"hello " + head.split(b" ")[1] + b"\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
