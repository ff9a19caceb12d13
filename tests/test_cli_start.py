"""``corral run`` starts without the parts of the library it does not use: what a command
imports is checked in a fresh interpreter (``sys.modules`` after the command), not timed
(bench/bench_cli_start.py has the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from corral.cli.options import PRESET_NAMES
from corral.tools.presets import PRESETS

PARSE_ONLY = """
import json, sys
from corral.cli import make_parser
argv = sys.argv[1:]
make_parser(argv).parse_args(argv)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after(script: str, *argv: str, cwd: Path | None = None) -> set[str]:
    """The modules a fresh interpreter holds after ``script`` (which prints them as JSON)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_preset_choices_are_the_presets() -> None:
    assert tuple(sorted(PRESETS)) == PRESET_NAMES


def test_parsing_a_run_command_line_imports_no_policy_model_and_no_event_loop() -> None:
    # What a remote client of `corral serve` needs before it branches off: argparse-level.
    argv = ["run", "--memory", "512M", "--cpus", "1", "-e", "A=1", "--network", "none"]
    loaded = loaded_after(PARSE_ONLY, *argv, "--", "true")
    assert {"pydantic", "corral.policy", "corral.sandbox", "asyncio"}.isdisjoint(loaded)


def test_importing_corral_imports_none_of_its_parts() -> None:
    loaded = loaded_after("import corral, json, sys; print(json.dumps(sorted(sys.modules)))")
    assert {"pydantic", "corral.policy", "corral.sandbox", "asyncio"}.isdisjoint(loaded)
