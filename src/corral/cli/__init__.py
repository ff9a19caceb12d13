"""The ``corral`` command: run, shell/attach/sessions, mcp, audit and doctor.

Each command lives in its own module with a ``register(subparsers)``; this module only builds
the parser and maps corral errors to a one-line message and a non-zero exit (no traceback):
2 for bad input, 125 when the sandbox itself failed (like ``docker run``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from corral import errors
from corral.cli import audit, doctor, interactive, mcp, run
from corral.cli.options import EXIT_SANDBOX, EXIT_USAGE, build_policy

__all__ = ["build_policy", "main", "make_parser"]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral", description="Run commands and code inside Linux sandboxes."
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in (run, doctor, interactive, mcp, audit):
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except errors.PolicyError as exc:
        print(f"corral: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except errors.SandboxError as exc:
        print(f"corral: [{exc.code}] {exc.message}", file=sys.stderr)
        return EXIT_USAGE if exc.code == errors.ErrorCode.INVALID_INPUT else EXIT_SANDBOX
    except KeyboardInterrupt:
        return 130
