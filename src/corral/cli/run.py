"""``corral run``: one command in a fresh sandbox."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING

from corral.cli.options import EXIT_USAGE, add_sandbox_options, build_policy
from corral.net.cli import add_network_options, refusal_lines
from corral.policy import parse_size

__all__ = ["cmd_run", "register"]

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(sub: SubParsers) -> None:
    run = sub.add_parser("run", help="run one command in a fresh sandbox")
    add_sandbox_options(run)
    run.add_argument("--memory", type=_size, metavar="SIZE", help="memory cap, e.g. 512M")
    run.add_argument("--cpus", type=float, metavar="N", help="CPU cap in cores, e.g. 1.5")
    run.add_argument("--pids", type=int, metavar="N", help="max processes in the box")
    run.add_argument("--timeout", type=float, metavar="SECS", help="kill the command after SECS")
    add_network_options(run)
    run.add_argument("--json", action="store_true", help="print one JSON object with the result")
    run.add_argument("--stdin", action="store_true", help="pass corral's stdin to the command")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=cmd_run)


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert isinstance(value, int)
    return value


def cmd_run(args: argparse.Namespace) -> int:
    from corral.sandbox import Sandbox

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("corral run: give a command after --, e.g. corral run -- make test", file=sys.stderr)
        return EXIT_USAGE
    policy = build_policy(args)

    async def go() -> int:
        async with Sandbox(policy, workspace=args.workspace) as sb:
            for warning in sb.warnings:
                print(f"corral: warning: {warning}", file=sys.stderr)
            result = await sb.run(command, timeout=args.timeout, stdin=_stdin_data(args))
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            if result.timed_out:  # the policy's exec_timeout_secs, or --timeout
                print(f"corral: timed out after {result.timeout or 0:g} s", file=sys.stderr)
            if result.oom_killed:
                print("corral: the memory limit killed a process (--memory)", file=sys.stderr)
            for line in refusal_lines(result.network_refusals):
                print(line, file=sys.stderr)
        if result.timed_out:
            return 124
        return result.exit_code if result.exit_code >= 0 else 128 - result.exit_code

    return asyncio.run(go())


def _stdin_data(args: argparse.Namespace) -> bytes | None:
    if args.stdin:
        return sys.stdin.buffer.read()
    return None
