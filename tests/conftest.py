"""Shared fixtures: real sandboxes, skipped with a reason where the host cannot make them."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from corral.backends import unavailable_reason
from corral.sessions.pty import PtySession

PROMPT = r"\$ $"
"""The prompt of /bin/sh (dash) in a box's PTY session."""


def _bwrap_unusable() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if os.geteuid() != 0:
        return "the bwrap backend needs root on the host"
    return None


BWRAP_SKIP = _bwrap_unusable()

# The backend contract: every test that takes the ``sandbox`` (or ``box_policy``) fixture runs
# on each of these. ``CORRAL_TEST_BACKENDS=bwrap,oci-runc`` narrows the set. The microVM
# backend has its own, smaller module (its boxes boot in seconds under TCG).
BACKENDS: dict[str, dict[str, Any]] = {
    "bwrap": {},
    "oci-runc": {"backend": "oci", "runtime": "runc"},
    "oci-crun": {"backend": "oci", "runtime": "crun"},
    "oci-runsc": {"backend": "oci", "runtime": "runsc"},
    "microvm": {"backend": "microvm"},
}
CONTRACT_BACKENDS = [
    name
    for name in os.environ.get("CORRAL_TEST_BACKENDS", "bwrap,oci-runc,oci-crun").split(",")
    if name in BACKENDS
]


@functools.cache
def backend_skip(name: str) -> str | None:
    """Why the named backend cannot run here (a skip reason), or None."""
    if name == "bwrap" or BWRAP_SKIP:
        return BWRAP_SKIP
    reason = unavailable_reason(Policy(**BACKENDS[name]))
    return f"{name}: {reason}" if reason else None


def backend_policy(name: str, **update: Any) -> Policy:
    """A policy for the named backend (skipping the test when it can't run here)."""
    reason = backend_skip(name)
    if reason:
        pytest.skip(reason)
    return Policy(**{**BACKENDS[name], **update})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("needs_bwrap") and BWRAP_SKIP:
            item.add_marker(pytest.mark.skip(reason=BWRAP_SKIP))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture(params=CONTRACT_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def box_policy(backend_name: str) -> Policy:
    """The default policy on the backend under test (build variants with model_copy)."""
    return backend_policy(backend_name)


@pytest.fixture
async def sandbox(box_policy: Policy, workspace: Path) -> AsyncIterator[Sandbox]:
    async with Sandbox(box_policy, workspace=workspace) as sb:
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


def dead_pid() -> int:
    """A pid that is certainly not running: a child this process started and reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
