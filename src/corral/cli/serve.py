"""``corral serve``: hold boxes for other processes, over HTTP on a unix socket or TCP.

::

    corral serve                          # the default socket: $XDG_RUNTIME_DIR/corral/serve.sock
    corral serve --socket /run/corral.sock
    corral serve --listen 127.0.0.1:7420  # TCP: a bearer token is required

Over TCP a token is always required (any local user can reach a loopback port): ``--token``
or ``$CORRAL_TOKEN``, else the one in the 0600 token file of an earlier run at the same
address, else a new one written there; its path is printed, and the CLI finds it.
``--read-token`` adds a read-only token (for dashboards and monitors). A unix socket is 0600
and serves its owner only, checked by peer uid: no token. Over TCP the web dashboard's URL
is printed too, its token in the fragment (``/#token=...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from corral import errors

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["cmd_serve", "register"]


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"got {text!r}, must be a number greater than 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, must be a whole number >= 1")
    return int(text)


def register(sub: SubParsers) -> None:
    p = sub.add_parser("serve", help="serve boxes over HTTP (the API, `corral create`/`exec`)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--listen", metavar="HOST:PORT", help="TCP address (token required)")
    where.add_argument("--socket", metavar="PATH", help="unix socket (default: the user's)")
    p.add_argument("--token", help="operator bearer token (default: $CORRAL_TOKEN, else new)")
    p.add_argument("--read-token", help="an extra read-only token")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another Host header name to answer to, with any port or none (behind a proxy)",
    )
    p.add_argument("--max-boxes", type=_count, default=64, help="boxes held at once")
    p.add_argument("--max-starting", type=_count, default=4, help="boxes starting at once")
    p.add_argument(
        "--start-timeout",
        type=_positive,
        default=60.0,
        metavar="SECS",
        help="start budget per box; past it the caller gets server_busy",
    )
    p.add_argument("--ttl", type=_positive, metavar="SECS", help="default box TTL")
    p.add_argument("--idle-timeout", type=_positive, metavar="SECS", help="default idle timeout")
    p.add_argument("--pool-size", type=_count, default=2, help="warm boxes per policy for run")
    p.set_defaults(func=cmd_serve)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise errors.SandboxError(
            f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:7420",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return host, int(port)


def cmd_serve(args: argparse.Namespace) -> int:
    from corral.cli.run import parse_run_args
    from corral.client.fast import default_socket, token_file_name
    from corral.server.auth import WILDCARDS, Access, TokenScope
    from corral.server.boxes import ServeLimits
    from corral.server.serve import ServeConfig, serve
    from corral.server.transport import (
        LOOPBACK,
        bind_unix,
        kept_token,
        new_token,
        runtime_dir,
        write_token_file,
    )

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    tokens: dict[str, TokenScope] = {}
    unix_path: Path | None = None
    bound: os.stat_result | None = None
    dashboard: str | None = None
    if args.read_token:
        tokens[args.read_token] = "read"
    if args.listen:
        host, port = _listen(args.listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise errors.SandboxError(
                f"cannot listen on {args.listen}: {exc.strerror}",
                code=errors.ErrorCode.INVALID_INPUT,
            ) from None
        sock.listen(128)
        port = sock.getsockname()[1]
        # On every address, the URL to print (and the token file the CLI looks for) is
        # loopback's: the one address sure to be there.
        shown = host if host not in WILDCARDS else "::1" if ":" in host else "127.0.0.1"
        token = args.token or os.environ.get("CORRAL_TOKEN") or None
        where = "token from --token" if args.token else "token from CORRAL_TOKEN"
        if token is None:
            name = token_file_name(shown, port)
            token = kept_token(name) or new_token()
            path = write_token_file(token, name)
            where = f"token in {path}"
        tokens[token] = "operate"
        if host in WILDCARDS:
            where = f"and every other address of this machine; {where}"
        if host not in LOOPBACK:
            where += "; NOT loopback: put TLS in front of it"
        url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}"
        access = Access.tcp(tokens, host, port, args.allow_host)
        said = f"corral serve: listening on {url} ({where})"
        # The token rides in the fragment, which a browser keeps to itself: not in the
        # server's request line, not in a proxy's log, not in a Referer.
        dashboard = f"corral serve: dashboard at {url}/#token={token}"
    else:
        path = Path(args.socket) if args.socket else Path(default_socket())
        if not args.socket:
            runtime_dir()  # makes the private directory of the default socket
        unix_path = path.absolute()
        sock = bind_unix(unix_path)
        bound = os.lstat(unix_path)
        if args.token:
            tokens[args.token] = "operate"
        access = Access(tokens=tokens, unix_owner=not args.token)
        url = f"unix:{path.absolute()}"
        said = f"corral serve: listening on {url} (uid {os.getuid()} only)"
    limits = ServeLimits(
        max_boxes=args.max_boxes,
        max_starting=args.max_starting,
        start_timeout=args.start_timeout,
        default_ttl=args.ttl,
        default_idle=args.idle_timeout,
        pool_size=args.pool_size,
    )
    config = ServeConfig(access=access, limits=limits, info={"url": url})
    if dashboard is not None:
        print(dashboard, file=sys.stderr, flush=True)
    print(said, file=sys.stderr, flush=True)
    try:
        asyncio.run(serve(config, parse_run_args, sock=sock))
    except KeyboardInterrupt:
        pass
    finally:
        if unix_path is not None:
            _remove_socket(unix_path, bound)
    return 0


def _remove_socket(path: Path, bound: os.stat_result | None) -> None:
    """Remove the socket this server bound, and nothing else put there since."""
    with contextlib.suppress(OSError):
        now = os.lstat(path)
        if bound is not None and (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
            path.unlink()
