"""Shared fixtures: real sandboxes, skipped with a reason where the host cannot make them."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.pty import PtySession

PROMPT = r"\$ $"
"""The prompt of /bin/sh (dash) in a box's PTY session."""


def _bwrap_unusable() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if os.geteuid() != 0:
        return "the bwrap backend needs root on the host"
    return None


BWRAP_SKIP = _bwrap_unusable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("needs_bwrap") and BWRAP_SKIP:
            item.add_marker(pytest.mark.skip(reason=BWRAP_SKIP))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
async def sandbox(workspace: Path) -> AsyncIterator[Sandbox]:
    if BWRAP_SKIP:
        pytest.skip(BWRAP_SKIP)
    async with Sandbox(Policy(), workspace=workspace) as sb:
        yield sb


@pytest.fixture
def sessions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private directory for the attach server's socket (used by the PTY tests)."""
    path = tmp_path / "sessions"
    monkeypatch.setenv("CORRAL_SESSIONS_DIR", str(path))
    return path


@pytest.fixture
async def sh(sandbox: Sandbox) -> AsyncIterator[PtySession]:
    """A shell session in the test's box, at its first prompt."""
    session = await sandbox.shell()
    assert (await session.expect(PROMPT, 10)).matched
    yield session
    await session.close()
