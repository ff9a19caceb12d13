"""``corral run`` starts without the parts of the library it does not use: what a command
imports is checked in a fresh interpreter (``sys.modules`` after the command), not timed
(bench/bench_cli_start.py has the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from corral.cli.options import PRESET_NAMES
from corral.tools.presets import PRESETS

RUN_TRUE = """
import dataclasses, json, sys
from corral.cli import main
docless = []
process_class = dataclasses._process_class
def checking(cls, *args):
    # dataclasses builds a missing docstring from inspect.signature (at import, each time)
    if cls.__module__.startswith("corral") and not cls.__dict__.get("__doc__"):
        docless.append(cls.__qualname__)
    return process_class(cls, *args)
dataclasses._process_class = checking
code = main(["run", *sys.argv[1:], "--", "true"])
assert code == 0, code
print(json.dumps(docless))
print(json.dumps(sorted(sys.modules)))
"""
NOT_FOR_A_RUN = {
    # the agent tools and the MCP server
    "mcp",
    "corral.tools.toolbox",
    "corral.tools.catalog",
    "corral.tools.schemas",
    "corral.tools.results",
    "corral.tools.approvals",
    "corral.cli.mcp",
    # images, pools, the sync facade
    "corral.images",
    "corral.pool",
    "corral.sync",
    # sessions but the registry every sandbox has (no shell was opened)
    "corral.sessions.batch",
    "corral.sessions.attach",
    # the network of a box that has one
    "corral.net.proxy",
    "corral.net.nat",
    "corral.net.ports",
    "corral.net.publish",
    "corral.net.tunnel",
    "corral.net.http",
    # other commands
    "corral.cli.interactive",
    "corral.cli.doctor",
    "corral.cli.audit",
    "corral.cli.image",
    # what pydantic's plugin loader and asyncio's TLS transports import (corral.cli.lean)
    "importlib.metadata",
    "email",
    "zipfile",
    "ssl",
    "_ssl",
}
PARSE_ONLY = """
import json, sys
from corral.cli import make_parser
argv = sys.argv[1:]
make_parser(argv).parse_args(argv)
print(json.dumps(sorted(sys.modules)))
"""


def printed_by(script: str, *argv: str, cwd: Path | None = None) -> list[str]:
    """The lines ``script`` prints in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def loaded_after(script: str, *argv: str, cwd: Path | None = None) -> set[str]:
    """The modules a fresh interpreter holds after ``script`` (which prints them as JSON)."""
    return set(json.loads(printed_by(script, *argv, cwd=cwd)[-1]))


def test_the_preset_choices_are_the_presets() -> None:
    assert tuple(sorted(PRESETS)) == PRESET_NAMES


def test_parsing_a_run_command_line_imports_no_policy_model_and_no_event_loop() -> None:
    # What a remote client of `corral serve` needs before it branches off: argparse-level.
    argv = ["run", "--memory", "512M", "--cpus", "1", "-e", "A=1", "--network", "none"]
    loaded = loaded_after(PARSE_ONLY, *argv, "--", "true")
    assert {"pydantic", "corral.policy", "corral.sandbox", "asyncio"}.isdisjoint(loaded)


@pytest.mark.needs_bwrap
def test_run_imports_only_what_running_a_box_needs(workspace: Path) -> None:
    *_, docless, modules = printed_by(RUN_TRUE, "--workspace", str(workspace))
    loaded = set(json.loads(modules))
    assert "corral.sandbox" in loaded  # the walk really ran a box
    assert sorted(NOT_FOR_A_RUN & loaded) == []
    # A dataclass without a docstring costs a run an inspect.signature at import.
    assert json.loads(docless) == []


@pytest.mark.needs_bwrap
def test_a_run_with_a_network_imports_what_that_network_needs(workspace: Path) -> None:
    loaded = loaded_after(RUN_TRUE, "--workspace", str(workspace), "-p", "0:8000")
    assert {"corral.net.publish", "corral.net.proxy"} <= loaded


def test_version_registers_no_command() -> None:
    script = """
import contextlib, io, json, sys
from corral.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--version"])
assert out.getvalue().startswith("corral "), out.getvalue()
print(json.dumps(sorted(sys.modules)))
"""
    loaded = loaded_after(script)
    assert {m for m in loaded if m.startswith(("corral.cli.", "corral.client"))} == {
        "corral.cli.options"
    }


def test_importing_corral_imports_none_of_its_parts() -> None:
    loaded = loaded_after("import corral, json, sys; print(json.dumps(sorted(sys.modules)))")
    assert {"pydantic", "corral.policy", "corral.sandbox", "asyncio"}.isdisjoint(loaded)


LEAN = """
import json, sys
from corral.cli.lean import lean_imports
lean_imports()
from corral.policy import Policy
Policy(limits={"memory_bytes": "64M"})
import asyncio
assert asyncio.sslproto.ssl is None
import ssl  # still importable by whatever else wants it
ssl.create_default_context()
from pydantic.plugin._loader import get_plugins
assert tuple(get_plugins()) == ()
print(json.dumps(sorted(sys.modules)))
"""


def test_lean_imports_leave_out_pydantic_plugins_and_asyncio_ssl() -> None:
    loaded = loaded_after(LEAN)
    assert {"importlib.metadata", "email", "zipfile"}.isdisjoint(loaded)


def test_lean_imports_change_nothing_already_imported() -> None:
    script = """
import asyncio, json, sys, pydantic
from corral.cli.lean import lean_imports
loader = sys.modules.get("pydantic.plugin._loader")
lean_imports()
assert sys.modules.get("pydantic.plugin._loader") is loader
assert asyncio.sslproto.ssl is sys.modules["ssl"]
print(json.dumps(sorted(sys.modules)))
"""
    assert "ssl" in loaded_after(script)
