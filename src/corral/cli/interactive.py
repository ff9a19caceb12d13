"""``corral shell``, ``corral attach`` and ``corral sessions`` (registered by corral.cli).

``corral shell`` opens a shell in a fresh sandbox and attaches this terminal to it at once.
Detaching (Ctrl-] by default) does not end it: this process prints the session id and keeps
the sandbox alive, serving the session for ``corral attach``, until the shell exits or you
press Ctrl-C here (which closes the sandbox). The exit status is the shell's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from typing import TYPE_CHECKING, Any

from corral.cli.options import add_raw_option, terminal_safe
from corral.sessions import attach
from corral.sessions.terminal import (
    DEFAULT_DETACH_KEYS,
    AttachOutcome,
    attach_terminal,
    default_shell,
    parse_detach_keys,
    window_size,
)

__all__ = ["register"]

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(sub: SubParsers) -> None:
    from corral.cli.options import add_sandbox_options
    from corral.net.cli import add_publish_option

    shell = sub.add_parser("shell", help="an interactive shell in a fresh sandbox")
    add_sandbox_options(shell)
    add_publish_option(shell)
    shell.add_argument(
        "--shell", default=None, help="shell in the box (default: bash if the box has it, else sh)"
    )
    _detach_option(shell)
    shell.set_defaults(func=cmd_shell)

    att = sub.add_parser("attach", help="attach this terminal to a running session")
    att.add_argument("session_id", metavar="SESSION_ID", help="id (or unique prefix)")
    _detach_option(att)
    att.set_defaults(func=cmd_attach)

    ls = sub.add_parser("sessions", help="list sessions that can be attached")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    add_raw_option(ls)
    ls.set_defaults(func=cmd_sessions)


def _detach_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--detach-keys",
        default=DEFAULT_DETACH_KEYS,
        metavar="KEYS",
        help="key sequence that detaches, e.g. ctrl-q or ctrl-p,ctrl-q (default: ctrl-])",
    )


def _status(code: int | None) -> int:
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


def _say(message: str) -> None:
    # \r first: the terminal may have just left raw mode mid-line.
    print(f"\r\ncorral: {message}", file=sys.stderr, flush=True)


def cmd_attach(args: argparse.Namespace) -> int:
    keys = parse_detach_keys(args.detach_keys)
    path, info = attach.locate(args.session_id)
    session_id = str(info["session_id"])
    outcome = asyncio.run(attach_terminal(path, session_id, detach_keys=keys))
    return _report(outcome, session_id)


def _report(outcome: AttachOutcome, session_id: str) -> int:
    if outcome.reason == "detached":
        _say(f"detached from session {session_id}; `corral attach {session_id}` to return")
        return 0
    if outcome.reason == "lost":
        _say(f"the process owning session {session_id} went away")
        return 1
    how = {-1: "hung up (SIGHUP)", -9: "killed (SIGKILL)"}.get(outcome.exit_code or 0)
    if how is not None:
        _say(
            f"session {session_id} ended: its shell was {how}, usually because the "
            "sandbox owning it closed (its corral process was interrupted or ended)"
        )
    return _status(outcome.exit_code)


def cmd_shell(args: argparse.Namespace) -> int:
    from corral import errors
    from corral.cli.options import build_policy, checked_workspace, with_presets
    from corral.cli.run import with_signals
    from corral.net.cli import say_published
    from corral.sandbox import Sandbox

    parse_detach_keys(args.detach_keys)  # a bad one fails before the box starts
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise errors.SandboxError(
            "corral shell needs a terminal on stdin and stdout; for piped input use "
            "corral run --stdin -- sh",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    workspace = checked_workspace(args)
    policy = with_presets(build_policy(args), args, workspace)

    async def go() -> int:
        async with Sandbox(
            policy,
            workspace=workspace,
            allow_dangerous_workspace=getattr(args, "force_workspace", False),
        ) as sb:
            for warning in sb.warnings:
                print(f"corral: warning: {warning}", file=sys.stderr)
            say_published(sb)
            shell = args.shell or await default_shell(sb.run)
            cols, rows = window_size(1)
            session = await sb.shell(shell, cols=cols, rows=rows)
            sid = session.session_id
            print(
                f"corral: {shell} in a fresh box (session {sid}); {args.detach_keys} detaches, "
                "exit ends it",
                file=sys.stderr,
                flush=True,
            )
            outcome = await sb.reattach(session, detach_keys=args.detach_keys)
            if outcome.reason != "detached":
                return _status(await session.wait_closed())
            _say(
                f"detached; session {sid} keeps running.\n"
                f"  reattach:  corral attach {sid}\n"
                "  this process serves it until the shell exits; Ctrl-C here ends it"
            )
            return _status(await session.wait_closed())

    return with_signals(go())


def cmd_sessions(args: argparse.Namespace) -> int:
    found = [info for _, info in attach.list_sessions()]
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no attachable sessions")
        return 0
    rows = [("SESSION", "SHELL", "OWNER PID", "CREATED", "ATTACHED")]
    rows += [_row(info) for info in found]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        print(terminal_safe(line, sys.stdout, args))
    return 0


def _row(info: dict[str, Any]) -> tuple[str, str, str, str, str]:
    created = info.get("created_at")
    when = (
        datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
        if isinstance(created, int | float)
        else "?"
    )
    attached = info.get("attached")
    return (
        str(info.get("session_id")),
        str(info.get("shell")),
        str(info.get("owner_pid")),
        when,
        f"yes ({attached})" if isinstance(attached, int) and attached else "no",
    )
