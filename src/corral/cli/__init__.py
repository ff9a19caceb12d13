"""The ``corral`` command: run, shell/attach/sessions, mcp, audit, doctor and image.

Each command lives in its own module with a ``register(subparsers)``; this module only builds
the parser and maps corral errors to a one-line message and a non-zero exit (no traceback):
2 for bad input, 125 when the sandbox itself failed (like ``docker run``). With ``--json`` the
error is a JSON object on stdout too. A reader that goes away (``corral doctor --json | head``)
ends corral quietly with 141, like any program killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from corral import errors
from corral.cli.options import EXIT_SANDBOX, EXIT_USAGE, Parser, UsageError

if TYPE_CHECKING:
    from corral.cli.options import build_policy

__all__ = ["build_policy", "main", "make_parser"]

EXIT_PIPE = 141
EXIT_OUTPUT = 120
"""stdout could not take the output (what Python itself exits with when its flush fails)."""
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
"""A write to stdout failing with these is the output's destination, not corral."""

# The first imports of the command are argparse-level: each command's module is imported only
# when that command runs (or for the full help), and each keeps the library out of its own
# top level, so `corral run` pays for what running a box needs and nothing else.
MODULES = ("run", "doctor", "interactive", "mcp", "audit", "image", "serve")
"""The modules of ``corral.cli`` that register commands, in the order ``--help`` lists them."""
COMMANDS = {
    "run": "run",
    "doctor": "doctor",
    "shell": "interactive",
    "attach": "interactive",
    "sessions": "interactive",
    "mcp": "mcp",
    "audit": "audit",
    "image": "image",
    "serve": "serve",
}
"""Command -> the module of ``corral.cli`` that registers it."""


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("corral")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Version(argparse.Action):
    """``--version``: the installed version, read (importlib.metadata) only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"corral {_version()}")
        parser.exit()


def make_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``corral`` parser. Given the command line it will parse, only the named command
    is registered (its module alone is imported); otherwise every command is."""
    parser = Parser(
        prog="corral",
        description="Run commands and code inside Linux sandboxes.",
        epilog="With a running `corral serve` (CORRAL_HOST, or the default socket): corral "
        "create, exec, ps, cp, logs and rm manage boxes that outlive one call, and corral run "
        "goes through the server (see docs/serve.md).",
    )
    parser.add_argument("--version", action=_Version, help="show corral's version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    first = argv[0] if argv else None
    named = COMMANDS.get(first) if first else None
    # `--version` exits as soon as it is parsed: it needs no command at all.
    for name in () if first == "--version" else (named,) if named else MODULES:
        importlib.import_module(f"corral.cli.{name}").register(sub)
    return parser


def __getattr__(name: str) -> Any:
    if name == "build_policy":
        from corral.cli.options import build_policy

        return build_policy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _wants_json(argv: Sequence[str]) -> bool:
    for arg in argv:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _fail(message: str, code: str, status: int, as_json: bool) -> int:
    if as_json:
        import json

        print(json.dumps({"error": {"code": code, "message": message}}))
    else:
        text = f"corral: {message}" if not message.startswith("corral") else message
        if sys.stderr.isatty():  # a message may carry what a box or its agent wrote
            from corral.output import for_terminal

            text = for_terminal(text)
        print(text, file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """The ``corral`` command in this process (the console script first tries a running
    server: :func:`corral.client.cli.main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(argv)
    try:
        try:
            args = make_parser(argv).parse_args(argv)
        except UsageError as exc:
            return _fail(str(exc), str(errors.ErrorCode.INVALID_INPUT), EXIT_USAGE, as_json)
        _import_pydantic_core()
        try:
            return int(args.func(args))
        except errors.PolicyError as exc:
            return _fail(exc.message, str(exc.code), EXIT_USAGE, as_json)
        except errors.SandboxError as exc:
            usage = exc.code == errors.ErrorCode.INVALID_INPUT
            message = exc.message if usage or as_json else f"[{exc.code}] {exc.message}"
            return _fail(message, str(exc.code), EXIT_USAGE if usage else EXIT_SANDBOX, as_json)
        except KeyboardInterrupt:
            return 130
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_PIPE
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            _quiet_stdout()
            return EXIT_PIPE
        if exc.errno not in OUTPUT_ERRNOS or exc.filename is not None:
            raise
        # stdout cannot take the output (a full disk, a dead device): one line, no traceback.
        _quiet_stdout()
        sys.stderr.write(f"corral: cannot write the output: {os.strerror(exc.errno)}\n")
        return EXIT_OUTPUT


def _import_pydantic_core() -> None:
    """Import pydantic's compiled core (every command that builds a policy needs it) with a
    Ctrl-C ending the process at once: a KeyboardInterrupt raised inside its initialisation
    makes it abort with a Rust panic (exit 1, a panic message) instead of exiting 130. No
    box exists yet, so there is nothing to clean up."""
    import signal

    if "pydantic_core" in sys.modules or signal.getsignal(signal.SIGINT) is not (
        signal.default_int_handler
    ):
        return
    signal.signal(signal.SIGINT, lambda number, frame: os._exit(130))
    try:
        import pydantic_core  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _quiet_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so the flush at exit does not
    raise again (Python's own advice for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
