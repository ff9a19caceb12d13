"""examples/agent_loop.py, the docs' runnable agent demo: every scenario gets what it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_bwrap

AGENT_LOOP = Path(__file__).resolve().parent.parent / "examples" / "agent_loop.py"


def test_agent_loop_replays_the_spec_scenarios_through_mcp() -> None:
    # The example checks each tool result itself (exit 1 naming the one that was wrong); its
    # patterns match what the programs print, never the terminal's echo of the typed command.
    r = subprocess.run(
        [sys.executable, str(AGENT_LOOP)], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all scenarios passed" in r.stdout
    assert '"captures": [\n    "version 1.7",\n    "1.7"\n  ]' in r.stdout
    assert "got: Detected version 1.7" in r.stdout
    assert "tests: 47 passed" in r.stdout
