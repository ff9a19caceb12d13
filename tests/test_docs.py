"""The docs are code: every fenced block of README.md and docs/*.md runs or is checked here.

A reader copies these blocks as they are, so a block that stops working is a failing test,
named after its file, section and position (``README.md::python-quickstart::1``).

What each fence's language means here:

- ``python``: run as a program (top-level ``await`` allowed, as in ``python -m asyncio``), in a
  subprocess, with a fresh temporary directory as the working directory (so
  ``workspace="."`` is that directory), against real boxes, with a time limit. Its stdin is
  ``y`` (for an approver that asks); ``OPENAI_BASE_URL`` points at a scripted model on
  127.0.0.1 (``tests/scripted_model.py``), so the SDK examples run their loop for real.
- ``sh``/``bash``/``console``: every command is checked. ``corral run|doctor|sessions|audit``
  commands run for real (the venv's ``corral`` first on ``PATH``); the others (``shell``,
  ``attach``, ``mcp``, which wait for a person or a client) go through corral's real argument
  parser. ``make TARGET`` must name a target of the Makefile; ``source``/``python FILE`` must
  name a file of the repository. A trailing ``# exits N`` says the exit status to expect.
  Any other program fails the test until a rule here says how to check it.
- ``toml``: a policy file: it loads, and a box starts with it and runs a command.
- ``json``: parses; an MCP client config's ``corral`` arguments go through corral's parser.
  ``text``: a figure, not checked. A fence without a language fails.

HTML comments on the lines right before a fence (one per line) change that:

- ``<!-- doc-test: continue -->`` (python): the block continues the previous python block of
  the same section; they run as one program (one test, named after the first block).
- ``<!-- doc-test: synopsis -->`` (shell): usage syntax (``[--opt VALUE]``, ``a|b``): each
  subcommand, option and listed choice must exist in corral's parser.
- ``<!-- doc-test: attach PROMPT TEXT ANSWER -->`` (python; shell words, so quote spaces): a
  person joins the block's shell session. When the program prints ``corral attach ID``, the
  test runs that command on a terminal of its own, waits for PROMPT on the screen, types TEXT
  and Enter, waits for ANSWER and detaches with Ctrl-] (the hand-off of docs/interactive.md,
  played for real).
- ``<!-- doc-test: prints TEXT... -->`` (python; shell words): the program's output contains
  each TEXT, so an example that runs but no longer does what its comments say fails too.
  It may stand beside one of the other markers (one marker per line).
- ``<!-- doc-test: toolbox TOOL ARGUMENTS -->`` (json): the block is what ``Toolbox.call(TOOL,
  ARGUMENTS)`` returns in a fresh box: the same keys and values, where a string ending in
  ``...`` stands for any text starting with what precedes it.
- ``<!-- doc-test: skip REASON -->``: not run; the test is skipped, showing REASON.
- ``<!-- doc-test: server -->`` (python or shell): a real ``corral serve`` runs on a unix
  socket of the test's own for the block, ``CORRAL_HOST`` names it; a shell block then runs
  whole in ``bash -eo pipefail`` (its variables and ``$(...)`` work as a reader's shell's
  would) and must exit 0, with ``prints`` markers checked against its output.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from corral import Policy, SyncSandbox
from corral.cli import make_parser
from corral.client.cli import SERVER_COMMANDS, server_parser
from scripted_model import ScriptedModel
from served import serving

pytestmark = pytest.mark.needs_bwrap

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
BLOCK_TIMEOUT = 60.0
"""Seconds one block (a python program or a shell command) may take."""

PYTHON = {"python", "py"}
SHELL = {"sh", "bash", "shell", "console"}
CHECKED = PYTHON | SHELL | {"toml", "json", "text"}
MARKER = re.compile(
    r"<!--\s*doc-test:\s*(continue|synopsis|skip|attach|prints|toolbox|server)\b\s*(.*?)\s*-->"
)

RUN_FOR_REAL = {"run", "doctor", "sessions", "audit"}
"""corral subcommands a doc's command runs for real; the others wait for a person or a client
(``shell``, ``attach``: a terminal; ``mcp``: an MCP client), so they are parsed only."""


@dataclass
class Block:
    path: Path
    section: str
    index: int
    """1-based position among the blocks of its section."""
    line: int
    lang: str
    text: str
    marker: str = ""
    reason: str = ""
    prints: list[str] = field(default_factory=list)
    """Texts the program's output must contain (``prints`` markers)."""
    parts: list[Block] = field(default_factory=list)
    """For a python block continued by later ones: itself and its continuations, in order."""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}::{self.section}::{self.index}"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-") or "top"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, with their section and doc-test marker."""
    blocks: list[Block] = []
    section, counts = "top", dict[str, int]()
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = _slug(line.lstrip("#"))
        fence = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", line)
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            body.append(lines[j].removeprefix(indent))
            j += 1
        counts[section] = counts.get(section, 0) + 1
        block = Block(path, section, counts[section], i + 1, lang.lower(), "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and (not lines[k].strip() or MARKER.search(lines[k])):
            mark = MARKER.search(lines[k])
            if mark and mark.group(1) == "prints":
                block.prints += shlex.split(mark.group(2))
            elif mark:
                assert not block.marker, f"{block.where}: one of continue/synopsis/skip/attach"
                block.marker, block.reason = mark.groups()
            k -= 1
        blocks.append(block)
        i = j + 1
    return blocks


def collect() -> list[Block]:
    """Every block to test; continued python blocks folded into the block they continue."""
    tests: list[Block] = []
    for path in DOCS:
        last_python: Block | None = None
        for block in parse_blocks(path):
            if block.marker == "continue":
                assert block.lang in PYTHON, f"{block.where}: only python blocks continue"
                assert last_python is not None and last_python.section == block.section, (
                    f"{block.where}: 'continue' needs a python block before it in its section"
                )
                last_python.parts.append(block)
                continue
            if block.lang in PYTHON:
                block.parts = [block]
                last_python = block
            tests.append(block)
    return tests


BLOCKS = collect()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    """An OpenAI-compatible chat API on 127.0.0.1 playing a model (``tests/scripted_model.py``)."""
    with ScriptedModel() as model:
        yield model.base_url


def _env(**extra: str) -> dict[str, str]:
    path = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **extra}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, workdir: Path, model_url: str) -> None:
    if block.marker == "skip":
        assert block.reason, f"{block.where}: a skip needs a reason"
        pytest.skip(f"{block.where}: {block.reason}")
    assert block.lang in CHECKED, (
        f"{block.where}: fence language {block.lang!r} is not checked; use one of "
        f"{sorted(CHECKED)} (``text`` for a figure)"
    )
    if block.marker == "server":
        with serving(workdir.parent / "run", "--socket", str(workdir.parent / "s.sock")) as srv:
            if block.lang in PYTHON:
                run_python(block, workdir, model_url, server=srv.url)
            else:
                run_shell_block(block, workdir, srv.url)
    elif block.lang in PYTHON:
        run_python(block, workdir, model_url)
    elif block.lang in SHELL:
        for argv, comment in shell_commands(block):
            check_command(block, argv, comment, workdir)
    elif block.lang == "toml":
        check_policy_toml(block, workdir)
    elif block.lang == "json":
        check_json(block, workdir)


# ---- python -----------------------------------------------------------------------------------

RUNNER = textwrap.dedent(
    """
    import sys, types
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, path, "exec")  # as `python file.py`: no top-level await
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
    """
)


def run_shell_block(block: Block, workdir: Path, server: str) -> None:
    """A shell block run whole, as a reader pastes it, against the test's server."""
    r = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", block.text],
        cwd=workdir,
        env=_env(CORRAL_HOST=server),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
    )
    print(r.stdout, r.stderr, sep="\n--- stderr\n")
    assert r.returncode == 0, (
        f"{block.where}: exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    )
    missing = [text for text in block.prints if text not in r.stdout + r.stderr]
    assert not missing, f"{block.where}: the output lacks {missing}\n--- stdout\n{r.stdout}"


def run_python(block: Block, workdir: Path, model_url: str, server: str | None = None) -> None:
    program = "\n".join(part.text for part in block.parts)
    script = workdir.parent / "doc_block.py"
    script.write_text(program, encoding="utf-8")
    # The SDK examples' model is the scripted one; nothing leaves the machine.
    env = _env(OPENAI_BASE_URL=model_url, OPENAI_API_KEY="doc-test", NO_PROXY="127.0.0.1")
    if server is not None:
        env["CORRAL_HOST"] = server
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(script)],
        cwd=workdir,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        before = play_person(block, proc, env) if block.marker == "attach" else ""
        # An approver that asks on stdin gets a yes.
        out, err = proc.communicate("y\n", timeout=BLOCK_TIMEOUT)
        out = before + out
    except BaseException:
        proc.kill()
        out, err = proc.communicate()
        print(out, err, sep="\n--- stderr\n")
        raise
    print(out, end="")  # shown by ``pytest -rP`` (and with a failure)
    assert proc.returncode == 0, (
        f"{block.where}: exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    )
    missing = [text for part in block.parts for text in part.prints if text not in out]
    assert not missing, f"{block.where}: the output lacks {missing}\n--- stdout\n{out}"


def _read_until(fd: int, pattern: str, seen: bytearray, deadline: float) -> None:
    while pattern.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} within {BLOCK_TIMEOUT} s; got {bytes(seen)[-500:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other end closed
                chunk = b""
            assert chunk, f"closed before {pattern!r}; got {bytes(seen)[-500:]!r}"
            seen += chunk


def play_person(block: Block, proc: subprocess.Popen[str], env: dict[str, str]) -> str:
    """Attach to the session the program names, answer its prompt, detach (see the marker).

    Returns what the program printed up to ``corral attach ID``."""
    deadline = time.monotonic() + BLOCK_TIMEOUT
    prompt, text, answer = shlex.split(block.reason)
    assert proc.stdout is not None and proc.stdin is not None
    lines = []
    for line in proc.stdout:  # bounded: the program exits (EOF) or the test times out
        lines.append(line)
        found = re.search(r"corral attach (\S+)", line)
        if found:
            break
    else:
        pytest.fail(f"{block.where}: the program never printed `corral attach ID`: {lines}")
    primary, secondary = pty.openpty()
    person = subprocess.Popen(
        ["corral", "attach", found.group(1)],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        start_new_session=True,
    )
    os.close(secondary)
    try:
        seen = bytearray()
        _read_until(primary, prompt, seen, deadline)  # the screen, replayed
        os.write(primary, text.encode() + b"\r")
        _read_until(primary, answer, seen, deadline)
        os.write(primary, b"\x1d")  # Ctrl-]: detach
        # 0: detached; 129: the program, done, closed its sandbox first (the shell hung up),
        # which a loaded machine lets happen before the Ctrl-] is read.
        assert person.wait(timeout=max(deadline - time.monotonic(), 1)) in (0, 129)
    finally:
        if person.poll() is None:
            person.kill()
            person.wait()
        os.close(primary)
    return "".join(lines)


# ---- shell --------------------------------------------------------------------------------------

SEPARATORS = {"|", "||", "&&", ";"}


def shell_commands(block: Block) -> Iterator[tuple[list[str], str]]:
    """Each simple command of a shell block, with the comment on its line."""
    text = block.text.replace("\\\n", " ")
    if block.marker == "synopsis":
        text = re.sub(r"\n[ \t]+", " ", text)  # an indented line continues the one above
    for raw in text.splitlines():
        line = raw.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue  # output, not a command
            line = line[2:]
        code, _, comment = line.partition(" #")
        if line.startswith("#"):
            code, comment = "", line
        tokens = shlex.split(code, comments=True)
        while tokens:
            cut = next((i for i, t in enumerate(tokens) if t in SEPARATORS), len(tokens))
            if cut:
                yield tokens[:cut], comment.strip()
            tokens = tokens[cut + 1 :]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.MULTILINE))


def check_command(block: Block, argv: list[str], comment: str, workdir: Path) -> None:
    program = Path(argv[0]).name
    if program == "make":
        missing = set(argv[1:]) - makefile_targets()
        assert not missing, f"{block.where}: no Makefile target {sorted(missing)}"
    elif program == "corral":
        check_corral(block, argv[1:], comment, workdir)
    elif program in {"source", "."} or re.fullmatch(r"python3?(\.\d+)?", program):
        path = ROOT / argv[1]
        assert path.exists(), f"{block.where}: {argv[1]} does not exist in the repository"
    elif "--" in argv and argv[argv.index("--") + 1 :][:1] == ["corral"]:
        # Another program starting corral (``claude mcp add NAME -- corral mcp ...``).
        check_command(block, argv[argv.index("--") + 1 :], comment, workdir)
    else:
        pytest.fail(f"{block.where}: no rule to check {argv[0]!r}: add one in {__file__}")


def _subparsers() -> dict[str, object]:
    """Every corral command's parser: the in-process CLI's, and the commands that need a
    server (``create``, ``exec``, ...: :mod:`corral.client.cli`)."""
    import argparse

    found: dict[str, object] = {}
    for parser in (make_parser(), server_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.update(action.choices)
    assert found, "corral's parser has no subcommands"
    return found


def check_corral(block: Block, args: list[str], comment: str, workdir: Path) -> None:
    if block.marker == "synopsis":
        check_synopsis(block, args)
        return
    parser = server_parser() if args[:1] and args[0] in SERVER_COMMANDS else make_parser()
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{block.where}: `corral {shlex.join(args)}` does not parse (exit {exc})")
    sub = next((a for a in args if not a.startswith("-")), "")
    if sub not in RUN_FOR_REAL:
        return
    expected = re.search(r"exits? (\d+)", comment)
    r = subprocess.run(
        ["corral", *args],
        cwd=workdir,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT,
    )
    want = int(expected.group(1)) if expected else 0
    assert r.returncode == want, (
        f"{block.where}: `corral {shlex.join(args)}` exited {r.returncode}, not {want}\n"
        f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    )


def check_synopsis(block: Block, args: list[str]) -> None:
    """``run [--memory 512M] [--network none|allowlist] -- CMD``: names and choices exist."""
    import argparse

    words = [w.strip("[]").removesuffix("...") for w in args]
    words = [w for w in words if w]
    sub = words[0] if words else ""
    subparsers = _subparsers()
    assert sub in subparsers, f"{block.where}: `corral {sub}` is not a corral command"
    parser = subparsers[sub]
    assert isinstance(parser, argparse.ArgumentParser)
    first = 1
    for word in words[1:]:  # ``image pull REF``: down into the command's own subcommands
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested or word.startswith("-"):
            break
        assert word in nested[0].choices, f"{block.where}: `corral {sub}` has no {word!r}"
        parser, first = nested[0].choices[word], first + 1
    options = {opt: a for a in parser._actions for opt in a.option_strings}
    for i, word in enumerate(words[first:], start=first):
        if word == "--":  # what follows is the command's (for create: corral run's flags)
            break
        if not word.startswith("-"):
            continue
        assert word in options, f"{block.where}: `corral {sub}` has no option {word}"
        action = options[word]
        value = words[i + 1] if i + 1 < len(words) else ""
        if action.choices is not None and "|" in value:
            unknown = set(value.split("|")) - {str(c) for c in action.choices}
            assert not unknown, f"{block.where}: {word} does not accept {sorted(unknown)}"


# ---- toml and json -------------------------------------------------------------------------------


def check_policy_toml(block: Block, workdir: Path) -> None:
    data = tomllib.loads(block.text)  # a syntax error fails here, naming the line
    assert isinstance(data, dict)
    policy_file = workdir.parent / "corral.toml"
    policy_file.write_text(block.text, encoding="utf-8")
    policy = Policy.load(policy_file)
    with SyncSandbox(policy, workspace=workdir) as sb:
        r = sb.run(["true"])
    assert r.exit_code == 0, f"{block.where}: a box with this policy ran `true`: {r}"


# ---- what the prose names -----------------------------------------------------------------------


def inline_spans(path: Path) -> Iterator[tuple[int, str]]:
    """Inline code spans (`...`) outside fenced blocks, with their line numbers."""
    in_fence = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = re.match(r"^\s*(`{3,})", line)
        if fence:
            in_fence = "" if in_fence and fence.group(1).startswith(in_fence) else fence.group(1)
            continue
        if not in_fence:
            for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
                yield number, span


SPANS = [(path, number, span) for path in DOCS for number, span in inline_spans(path)]
REPO_PATH = re.compile(r"^\.?[\w-][\w.-]*(/[\w.*-]+)*/?$")
"""A relative path (``backends/bwrap/args.py``, ``tests/test_microvm*.py``, ``sandbox.py``)."""
OUTSIDE_THE_REPO = {
    ".cursor/mcp.json",
    "claude_desktop_config.json",
    "config.json",
    "Cargo.toml",
    "package.json",
    "setup.py",
}
"""Files the docs name that are not in this repository: an MCP client's config in a user's
project or home, an OCI bundle's config.json, the project files a workspace preset is
picked by."""


def _names_a_file(span: str) -> bool:
    return (
        bool(REPO_PATH.match(span))
        and ("/" in span or re.search(r"\.(py|md|toml|json|js|sh)$", span) is not None)
        and span not in OUTSIDE_THE_REPO
    )


def _exists(span: str) -> bool:
    name, src = span.rstrip("/"), ROOT / "src" / "corral"
    return any(any(base.glob(name)) for base in (ROOT, src)) or any(src.rglob(name))


def test_files_named_in_the_docs_exist() -> None:
    """``backends/bwrap/args.py``, ``tests/test_microvm*.py``, ``sandbox.py``: a file the prose
    names exists (from the repository's root, or in the package: src/corral/)."""
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {span}"
        for path, number, span in SPANS
        if _names_a_file(span) and not _exists(span)
    ]
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_python_names_in_the_docs_exist() -> None:
    """``corral.tools.presets.rust_toolchain(policy)``: every dotted corral name resolves."""
    import importlib

    missing = []
    for path, number, span in SPANS:
        dotted = re.match(r"^corral(\.\w+)+", span)
        if not dotted:
            continue
        parts = dotted.group(0).split(".")
        obj: object = importlib.import_module("corral")
        for i, part in enumerate(parts[1:], start=2):
            try:
                obj = (
                    getattr(obj, part)
                    if hasattr(obj, part)
                    else importlib.import_module(".".join(parts[:i]))
                )
            except ImportError:
                missing.append(f"{path.relative_to(ROOT)}:{number}: {span}")
                break
    assert not missing, "the docs name things corral does not have:\n" + "\n".join(missing)


def test_corral_commands_in_the_prose_exist() -> None:
    """``corral run --backend microvm``, ``corral attach ID [--detach-keys ...]``: each command
    and option named in the prose exists in corral's parser (``python -m corral`` too)."""
    for path, number, span in SPANS:
        words = shlex.split(span.removeprefix("python -m "), posix=True)
        if len(words) > 1 and words[0] == "corral":
            block = Block(path, "prose", 0, number, "sh", span, "synopsis")
            check_synopsis(block, [w for w in words[1:] if w != "..."])


def check_json(block: Block, workdir: Path) -> None:
    doc = json.loads(block.text)
    for name, server in doc.get("mcpServers", {}).items() if isinstance(doc, dict) else ():
        if server.get("command") == "corral":
            args = server.get("args", [])
            try:
                make_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{block.where}: server {name}: `corral {shlex.join(args)}` is wrong")
    if block.marker == "toolbox":
        import asyncio

        from corral import Sandbox
        from corral.tools import Toolbox

        tool, arguments = shlex.split(block.reason)

        async def call() -> object:
            async with Sandbox(workspace=workdir) as sb:
                return await Toolbox(sb).call(tool, json.loads(arguments))

        real = json.loads(json.dumps(asyncio.run(call())))
        assert_like(doc, real, f"{block.where}: ")


def assert_like(doc: object, real: object, where: str) -> None:
    """``real`` is what ``doc`` shows: same keys, same values, ``"text..."`` a prefix."""
    if isinstance(doc, dict):
        assert isinstance(real, dict) and doc.keys() == real.keys(), f"{where}{doc} vs {real}"
        for key, value in doc.items():
            assert_like(value, real[key], f"{where}{key}.")
    elif isinstance(doc, str) and doc.endswith("..."):
        assert isinstance(real, str) and real.startswith(doc[:-3].rstrip()), f"{where}{real!r}"
    else:
        assert doc == real, f"{where} the docs say {doc!r}, corral returns {real!r}"


# ---- the parser itself ---------------------------------------------------------------------------


def test_readme_opens_with_the_two_command_quickstart() -> None:
    first = parse_blocks(ROOT / "README.md")[0]
    commands = [argv for argv, _ in shell_commands(first)]
    assert first.line < 5 and commands == [["make", "demo"], ["make", "test"]]


def test_every_doc_has_blocks_and_ids_are_unique() -> None:
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids))
    assert {b.path for b in BLOCKS} == set(DOCS)


def test_parser_reads_markers_sections_and_continuations(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# T\n## Use it\n```python\na = 1\n```\n<!-- doc-test: continue -->\n"
        "```python\nprint(a)\n```\n<!-- doc-test: skip needs a GPU -->\n\n"
        "<!-- doc-test: prints 'a b' c -->\n```sh\nnvidia-smi\n```\n",
        encoding="utf-8",
    )
    blocks = parse_blocks(doc)
    assert [(b.section, b.index, b.lang, b.marker) for b in blocks] == [
        ("use-it", 1, "python", ""),
        ("use-it", 2, "python", "continue"),
        ("use-it", 3, "sh", "skip"),
    ]
    assert blocks[2].reason == "needs a GPU"
    assert blocks[2].prints == ["a b", "c"]
    assert blocks[1].text == "print(a)\n"


def test_shell_commands_split_lines_pipes_prompts_and_exit_comments(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "```console\n$ corral run -- false  # exits 1\noutput line\n$ make a && make b\n```\n"
        "```sh\ncorral run \\\n  --json -- true | head -1\n```\n",
        encoding="utf-8",
    )
    console, sh = parse_blocks(doc)
    assert list(shell_commands(console)) == [
        (["corral", "run", "--", "false"], "exits 1"),
        (["make", "a"], ""),
        (["make", "b"], ""),
    ]
    assert list(shell_commands(sh)) == [
        (["corral", "run", "--json", "--", "true"], ""),
        (["head", "-1"], ""),
    ]


def test_the_readme_lists_exactly_the_tools_the_mcp_server_serves() -> None:
    from corral.tools import TOOLS

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    listed = re.search(r"serves the spec's tools \(([^)]*)\)", text)
    assert listed, "README.md: the MCP paragraph no longer lists the tools"
    assert set(re.findall(r"`([\w.]+)`", listed.group(1))) == {t.name for t in TOOLS}
