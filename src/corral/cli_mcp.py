"""``corral mcp``: its options live here so the CLI stays fast; the MCP SDK (about 0.7 s of
imports) is loaded only when the command actually runs."""

from __future__ import annotations

import argparse

from corral.tools.approvals import MODES
from corral.tools.presets import PRESETS


def add_mcp_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``corral mcp`` (called by :mod:`corral.cli`)."""
    p = subparsers.add_parser("mcp", help="serve the agent tools over MCP (stdio or HTTP)")
    p.add_argument("--policy", metavar="FILE", help="TOML policy file")
    p.add_argument("--workspace", metavar="DIR", help="host dir shared read-write (default: temp)")
    p.add_argument(
        "--capabilities",
        action="append",
        metavar="LIST",
        help="tools the agent may use, comma-separated (run_command, sandbox.exec, ...)",
    )
    p.add_argument("--permission-mode", choices=MODES, default="default")
    p.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[])
    p.add_argument("--secrets", metavar="FILE", help="NAME=value lines (plus CORRAL_SECRET_*)")
    p.add_argument("--http", metavar="HOST:PORT", help="streamable HTTP instead of stdio")
    p.set_defaults(func=_cmd_mcp)


def _cmd_mcp(args: argparse.Namespace) -> int:
    from corral.mcp_server import cmd_mcp

    return cmd_mcp(args)
