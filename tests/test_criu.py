"""What a snapshot says about processes it cannot keep: ``criu check`` asked once, its own
words quoted; a criu that passes is said to pass, and still not claimed as used."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral.backends.host import criu


@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    def make(script: str) -> None:
        exe = tmp_path / "criu"
        exe.write_text(f"#!/bin/sh\n{script}\n")
        exe.chmod(0o755)
        monkeypatch.setattr(shutil, "which", lambda name: str(exe))
        criu.criu_check.cache_clear()

    yield make
    criu.criu_check.cache_clear()


def test_a_failing_check_is_quoted(fake_criu: Callable[[str], None]) -> None:
    fake_criu(
        'echo "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds" >&2\n'
        'echo "Error (criu/crtools.c:260): Could not initialize" >&2; exit 1'
    )
    why = criu.process_state_unavailable("bwrap")
    assert why.startswith("process state needs CRIU, and `criu check` fails on this kernel")
    assert why.endswith(": vdso: Unexpected rt vDSO area bounds")


def test_a_passing_check_is_not_claimed(fake_criu: Callable[[str], None]) -> None:
    fake_criu('echo "Looks good."')
    why = criu.process_state_unavailable("bwrap")
    assert "`criu check` passes here (Looks good.)" in why
    assert "does not checkpoint processes through CRIU yet" in why


def test_other_backends_and_a_missing_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "microvm backend has no process checkpointing" in criu.process_state_unavailable(
        "microvm"
    )
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(criu, "_CANDIDATES", ())
    criu.criu_check.cache_clear()
    try:
        assert "criu is not installed" in criu.process_state_unavailable("bwrap")
    finally:
        criu.criu_check.cache_clear()
