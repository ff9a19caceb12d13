"""``corral mcp``: its options live here so the CLI stays fast; the MCP SDK (about 0.7 s of
imports) is loaded only when the command actually runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from corral import errors
from corral.net.cli import add_network_options, add_publish_option, apply_network_options
from corral.policy import Policy
from corral.tools import presets
from corral.tools.approvals import MODES
from corral.tools.presets import PRESETS
from corral.tools.secrets import SecretStore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from corral.tools.mcp import ServerConfig

    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["cmd_mcp", "config_from_args", "register"]


def register(sub: SubParsers) -> None:
    p = sub.add_parser("mcp", help="serve the agent tools over MCP (stdio or HTTP)")
    p.add_argument("--policy", metavar="FILE", help="TOML policy file")
    p.add_argument(
        "--trust-writable-policy",
        action="store_true",
        help="take a --policy file that lies where the box can write (you review it each run)",
    )
    p.add_argument("--workspace", metavar="DIR", help="host dir shared read-write (default: temp)")
    p.add_argument(
        "--force-workspace",
        action="store_true",
        help="accept /, a system directory or a home directory as the workspace",
    )
    p.add_argument(
        "--capabilities",
        action="append",
        metavar="LIST",
        help="tools the agent may use, comma-separated (run_command, sandbox.exec, ...)",
    )
    p.add_argument("--permission-mode", choices=MODES, default="default")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        action="append",
        default=[],
        help="share a toolchain from your home read-only (as corral run's --preset)",
    )
    p.add_argument(
        "--no-presets",
        action="store_true",
        help="apply no preset the --workspace's files ask for (Cargo.toml, package.json, ...)",
    )
    p.add_argument("--secrets", metavar="FILE", help="NAME=value lines (plus CORRAL_SECRET_*)")
    add_network_options(p)
    add_publish_option(p)  # the host address of each: the sandbox_info tool
    p.add_argument("--http", metavar="HOST:PORT", help="streamable HTTP instead of stdio")
    p.add_argument(
        "--unix",
        metavar="PATH",
        help="streamable HTTP on a unix socket (mode 0600, peers checked by uid; no token)",
    )
    p.add_argument(
        "--token",
        metavar="TOKEN",
        help="bearer token for --http (default: $CORRAL_MCP_TOKEN, else a new one written to "
        "a 0600 file under $XDG_RUNTIME_DIR/corral)",
    )
    p.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="serve --http on loopback without a token: any local user can drive the sandbox",
    )
    p.set_defaults(func=cmd_mcp)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    from corral.backends.host.safepath import refuse_inside, refuse_writable_policy
    from corral.backends.layout import writable_areas
    from corral.tools.mcp import ServerConfig, parse_capabilities
    from corral.workspaces import refuse_dangerous_workspace

    if args.workspace and not Path(args.workspace).is_dir():  # refused now, not per tool call
        raise errors.SandboxError(
            f"workspace {args.workspace} is not a directory; create it or pick another",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    trust = bool(getattr(args, "trust_writable_policy", False))
    loaded = Policy.load(args.policy, trust_writable=trust) if args.policy else Policy()
    names = list(args.preset)
    if args.workspace and not args.no_presets:
        for name, why in presets.detect(args.workspace, loaded).items():
            if name not in names:
                names.append(name)
                print(
                    f"corral mcp: preset {name} ({why}); --no-presets turns this off",
                    file=sys.stderr,
                )
    policy = presets.apply(loaded, names, args.workspace).derived_from(loaded)
    policy = apply_network_options(policy, args).derived_from(loaded)
    secrets = SecretStore.from_env()
    force = bool(getattr(args, "force_workspace", False))
    if args.workspace and not force:
        refuse_dangerous_workspace(
            args.workspace,
            fix="give --workspace a project directory, or none for a temporary one per "
            "session; to share it anyway, add --force-workspace",
        )
    if args.workspace:
        areas = writable_areas(policy, Path(args.workspace).resolve())
        refuse_writable_policy(policy.loaded_from, areas)
        refuse_inside("secrets_file", policy.secrets_file, areas)
        refuse_inside("--secrets", Path(args.secrets) if args.secrets else None, areas)
        refuse_inside("audit_log", policy.audit_log, areas)
    if policy.secrets_file is not None:
        secrets = secrets.merged(SecretStore.from_file(policy.secrets_file))
    if args.secrets:
        secrets = secrets.merged(SecretStore.from_file(args.secrets))
    return ServerConfig(
        policy=policy,
        workspace=Path(args.workspace).resolve() if args.workspace else None,
        capabilities=parse_capabilities(args.capabilities),
        permission_mode=args.permission_mode,
        secrets=secrets,
        allow_dangerous_workspace=force,
    )


def _say(line: str) -> None:
    # stdout is the protocol channel on stdio: everything else goes to stderr.
    print(f"corral mcp: {line}", file=sys.stderr, flush=True)


async def _stdio_until_interrupted(
    config: ServerConfig, serve_stdio: Callable[..., Awaitable[None]], line: str
) -> None:
    """``serve_stdio``, where a Ctrl-C (SIGINT) stops the server, closes its sandboxes and
    exits 130 at once: the MCP SDK reads stdin in a thread no cancellation stops, so the
    process would otherwise wait for the client to close stdin."""
    import signal

    task = asyncio.current_task()
    assert task is not None
    interrupted = False

    def on_interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    def after() -> None:
        if interrupted:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(130)

    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_interrupt)
    _say(line)  # once a Ctrl-C is handled: a client (or a test) may send one from now on
    await serve_stdio(config, after)


def cmd_mcp(args: argparse.Namespace) -> int:
    from corral.server.transport import LOOPBACK, bind_unix, new_token, write_token_file
    from corral.tools.mcp import describe_config, serve_http, serve_stdio

    config = config_from_args(args)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.unix:
        path = Path(args.unix).absolute()
        token = args.token or os.environ.get("CORRAL_MCP_TOKEN") or None
        sock = bind_unix(path)
        who = "token required" if token else f"uid {os.getuid()} only (SO_PEERCRED)"
        url = "http://localhost:1/mcp (any port: the Host check wants one)"
        _say(f"serving streamable HTTP on unix:{path} as {url}; {who}; " + describe_config(config))
        try:
            with sock:
                asyncio.run(
                    serve_http(
                        config, "localhost", 0, token=token, insecure_no_token=True, sock=sock
                    )
                )
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return 0
    if not args.http:
        line = f"serving on stdio; {describe_config(config)}"
        asyncio.run(_stdio_until_interrupted(config, serve_stdio, line))
        return 0
    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit():
        raise errors.SandboxError(
            f"--http wants HOST:PORT, got {args.http!r}", code=errors.ErrorCode.INVALID_INPUT
        )
    host = host.strip("[]")
    token = args.token or os.environ.get("CORRAL_MCP_TOKEN") or None
    insecure = bool(args.insecure_no_token) and token is None
    if insecure and host not in LOOPBACK:
        raise errors.PolicyError(f"--insecure-no-token is for loopback only, not {host}")
    # Bound before the line is printed: whoever reads it can connect at once (and port 0
    # shows the port the kernel picked).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if int(port) > 65535:
            raise OSError(errno.EINVAL, "a port is 0 to 65535")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise errors.SandboxError(
            f"cannot listen on {args.http}: {exc.strerror or exc}",
            code=errors.ErrorCode.INVALID_INPUT,
        ) from None
    bound = sock.getsockname()[1]
    import signal

    # uvicorn shuts down on SIGTERM, then raises it again: exit (143) through the finally.
    # Set before the token file exists and the line is printed: a SIGTERM sent as soon as
    # the line was read found the default action, and the token file stayed.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    where = "no token (--insecure-no-token: any local user can connect)"
    token_file: Path | None = None
    try:
        if token is None and not insecure:
            token = new_token()
            token_file = write_token_file(token, f"mcp-{host}-{bound}.token")
            where = f"token in {token_file} (send Authorization: Bearer <token>)"
        elif token is not None:
            where = "token from --token" if args.token else "token from CORRAL_MCP_TOKEN"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}/mcp"
        _say(f"serving streamable HTTP on {url}; {where}; {describe_config(config)}")
        with sock:
            asyncio.run(
                serve_http(config, host, bound, token=token, insecure_no_token=insecure, sock=sock)
            )
    finally:
        if token_file is not None:  # the token dies with the server: nothing to reuse it
            with contextlib.suppress(OSError):
                token_file.unlink()
    return 0
