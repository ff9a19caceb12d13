"""`make demo` runs examples/demo.py: keep it working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_bwrap

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_runs_the_main_job_end_to_end() -> None:
    r = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gcc exit 1" in r.stdout
    assert "output 'answer=42'" in r.stdout
    assert "poll after 0.5 s: timeout" in r.stdout
    assert "last line '5 passed'" in r.stdout
    assert "Read-only file system" in r.stdout
    assert "Network is unreachable" in r.stdout
