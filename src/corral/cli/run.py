"""``corral run``: one command in a fresh sandbox, shaped like ``docker run``.

Without ``--json`` the command's stdout and stderr go to corral's own, live and byte for byte
(nothing decoded, nothing held back, nothing cut). ``--json`` captures both instead, up to
``--output-bytes`` per stream, and prints one object; a capture that was cut says so in the
object (``truncated``) and on stderr.

Exit status: the command's; 124 on timeout; 128+N when killed by signal N (also when corral
itself receives SIGTERM, SIGHUP or SIGINT: the box is torn down first); 127 when the command is
not found, 126 when it is not executable; 125 when the sandbox itself failed; 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from corral import errors
from corral.bounds import (
    MAX_CPU_QUOTA,
    MAX_PIDS,
    MAX_SIZE,
    MIN_CPU_QUOTA,
    MIN_MEMORY_BYTES,
    MIN_PIDS,
    parse_size,
)
from corral.cli.options import (
    Parser,
    UsageError,
    add_raw_option,
    add_sandbox_options,
    build_policy,
    checked_workspace,
    terminal_safe,
    with_presets,
)
from corral.net.cli import (
    add_network_options,
    add_publish_option,
    refusal_lines,
    say_published,
)

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from corral.output import TerminalFilter
    from corral.policy import Policy
    from corral.sandbox import Sandbox

__all__ = ["RunPlan", "cmd_run", "parse_run_args", "plan_run", "register", "with_signals"]

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_TIMEOUT = 124
EXIT_SIGPIPE = 128 + signal.SIGPIPE
CHUNK = 1 << 16


def register(sub: SubParsers) -> None:
    run = sub.add_parser("run", help="run one command in a fresh sandbox")
    add_sandbox_options(run)
    run.add_argument(
        "--memory", type=_memory, metavar="SIZE", help="memory cap, e.g. 512M (at least 16M)"
    )
    run.add_argument(
        "--cpus", type=_cpus, metavar="N", help="CPU cap in cores, e.g. 1.5 (0.01 to 4096)"
    )
    run.add_argument("--pids", type=_pids, metavar="N", help="max processes in the box")
    run.add_argument(
        "--timeout", type=_timeout, metavar="SECS", help="end the command after SECS (> 0)"
    )
    run.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        type=_env,
        metavar="K=V",
        help="set a variable for the command (K alone: its value here)",
    )
    run.add_argument(
        "-v",
        "--mount",
        action="append",
        default=[],
        type=_mount,
        metavar="HOST:BOX[:ro|rw]",
        help="share a host directory at BOX (read-only unless :rw)",
    )
    run.add_argument(
        "-w", "--workdir", metavar="DIR", help="working directory in the box (default: workspace)"
    )
    add_network_options(run)
    add_publish_option(run)
    run.add_argument("--json", action="store_true", help="print one JSON object with the result")
    run.add_argument(
        "--output-bytes",
        type=_output_bytes,
        metavar="SIZE",
        help="with --json: bytes captured per stream (default 1M); beyond it head and tail "
        "are kept and the result says truncated",
    )
    run.add_argument("--stdin", action="store_true", help="pass corral's stdin to the command")
    add_raw_option(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=cmd_run)


# ---- flag values: one line naming the flag and what it takes ------------------------------


def _checked(flag: str, text: str, parse: Any, ok: Any, allowed: str) -> Any:
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"got {text!r}, {allowed}")
    return value


def _size(text: str) -> int:
    value = parse_size(text)
    if not isinstance(value, int):
        raise ValueError(text)
    return value


def _memory(text: str) -> int:
    return int(
        _checked(
            "--memory",
            text,
            _size,
            lambda v: MIN_MEMORY_BYTES <= v <= MAX_SIZE,
            f"must be a size from {MIN_MEMORY_BYTES >> 20}M to 8P, e.g. 512M or 2G",
        )
    )


def _cpus(text: str) -> float:
    return float(
        _checked(
            "--cpus",
            text,
            float,
            lambda v: math.isfinite(v) and MIN_CPU_QUOTA <= v <= MAX_CPU_QUOTA,
            f"must be a number of cores from {MIN_CPU_QUOTA} to {MAX_CPU_QUOTA:g}, e.g. 1.5",
        )
    )


def _pids(text: str) -> int:
    return int(
        _checked(
            "--pids",
            text,
            int,
            lambda v: MIN_PIDS <= v <= MAX_PIDS,
            f"must be a whole number from {MIN_PIDS} to {MAX_PIDS}",
        )
    )


def _timeout(text: str) -> float:
    return float(
        _checked(
            "--timeout",
            text,
            float,
            lambda v: math.isfinite(v) and v > 0,
            "must be a number of seconds greater than 0, e.g. 30 or 0.5",
        )
    )


def _output_bytes(text: str) -> int:
    return int(
        _checked(
            "--output-bytes", text, _size, lambda v: v >= 1, "must be a size of at least 1, e.g. 4M"
        )
    )


def _env(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not name or "\0" in text:
        raise argparse.ArgumentTypeError(f"got {text!r}, must be NAME=VALUE or NAME")
    if not eq:
        value = os.environ.get(name, "")
    return name, value


def _mount(text: str) -> dict[str, str]:
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) != 2 or not parts[0] or not parts[1].startswith("/"):
        raise argparse.ArgumentTypeError(
            f"got {text!r}, must be HOST:BOX or HOST:BOX:ro|rw, BOX an absolute path"
        )
    return {"host": str(Path(parts[0]).expanduser().resolve()), "guest": parts[1], "mode": mode}


# ---- the command -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """What ``corral run``'s flags ask for (also built by ``corral serve`` from a remote
    ``corral run``'s arguments). ``command`` is empty when an image's Cmd is to run."""

    policy: Policy
    workspace: str
    command: list[str]
    env: dict[str, str]


@functools.cache
def _run_parser() -> Parser:
    parser = Parser(prog="corral", add_help=False)
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    register(cast("SubParsers", sub))
    return parser


def parse_run_args(argv: list[str]) -> argparse.Namespace:
    """``corral run``'s flags parsed from ``argv`` (what follows ``run``), for ``corral
    serve``: bad flags are a corral error (``invalid_input``), never an exit (nor a help
    text printed into the server's log)."""
    flags = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in flags or "--help" in flags:
        raise errors.SandboxError(
            "--help is not a sandbox flag: `corral run --help` prints them",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    try:
        return _run_parser().parse_args(["run", *argv])
    except UsageError as exc:
        raise errors.SandboxError(str(exc), code=errors.ErrorCode.INVALID_INPUT) from None
    except SystemExit:  # run's own --help
        raise errors.SandboxError(
            "corral run's arguments were not understood", code=errors.ErrorCode.INVALID_INPUT
        ) from None


def plan_run(args: argparse.Namespace, say: Callable[[str], object] | None = None) -> RunPlan:
    """The policy, workspace, command and variables of ``corral run``'s parsed flags (the
    presets it picks said on stderr, or to ``say``)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command and not getattr(args, "image", None):
        raise _no_command()
    workspace = checked_workspace(args)
    policy = with_presets(build_policy(args), args, workspace, say)
    if args.mount:
        fs = policy.filesystem
        mounts = [m.model_dump() for m in fs.mounts] + list(args.mount)
        policy = policy.from_dict(
            {**policy.model_dump(), "filesystem": {**fs.model_dump(), "mounts": mounts}}
        )
    if args.output_bytes is not None:
        limits = policy.limits.model_copy(update={"output_bytes": args.output_bytes})
        policy = policy.model_copy(update={"limits": limits})
    return RunPlan(policy, workspace, command, dict(args.env))


def cmd_run(args: argparse.Namespace) -> int:
    from corral.cli.lean import lean_imports

    lean_imports()  # before pydantic and asyncio are first imported
    from corral.sandbox import Sandbox

    plan = plan_run(args)
    policy, workspace, command, env = plan.policy, plan.workspace, plan.command, plan.env

    async def go() -> int:
        async with Sandbox(
            policy,
            workspace=workspace,
            allow_dangerous_workspace=getattr(args, "force_workspace", False),
        ) as sb:
            for warning in sb.warnings:
                print(f"corral: warning: {warning}", file=sys.stderr)
            say_published(sb)
            nonlocal command
            if not command:  # an image's Entrypoint + Cmd, as docker run runs them
                image_cmd = sb.image_config.cmd if sb.image_config else None
                if not image_cmd:
                    raise _no_command(" (the image names no Cmd or Entrypoint)")
                command = list(image_cmd)
            try:
                if args.json:
                    return await _captured(sb, args, command, env)
                return await _streamed(sb, args, command, env)
            except errors.SpawnFailed as exc:
                return _spawn_failed(exc, args.json)

    return with_signals(go())


def _no_command(why: str = "") -> errors.SandboxError:
    return errors.SandboxError(
        f"give a command after --, e.g. corral run -- make test{why}",
        code=errors.ErrorCode.INVALID_INPUT,
    )


def _spawn_failed(exc: errors.SpawnFailed, as_json: bool) -> int:
    """Like a shell: 127 for a command not found, 126 for one that cannot be executed."""
    status = EXIT_NOT_FOUND if isinstance(exc, errors.CommandNotFound) else EXIT_NOT_EXECUTABLE
    if as_json:
        print(json.dumps({**exc.to_dict(), "exit_code": status}))
    else:
        print(terminal_safe(f"corral: {exc.message}", sys.stderr, None), file=sys.stderr)
    return status


def with_signals(main: Any) -> int:
    """Run ``main``; SIGTERM and SIGHUP cancel it like Ctrl-C does, so the sandbox is torn
    down (state dir, mounts, cgroup) before corral exits with 128+N."""
    import asyncio

    async def guarded() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        received: list[int] = []

        def stop(signum: int) -> None:
            if not received:
                received.append(signum)
                task.cancel()

        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, stop, signum)
        try:
            return int(await main)
        except asyncio.CancelledError:
            if received:
                return 128 + received[0]
            raise
        finally:
            for signum in (signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(signum)

    try:
        return asyncio.run(guarded())
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _status(code: int, timed_out: bool) -> int:
    if timed_out:
        return EXIT_TIMEOUT
    return code if code >= 0 else 128 - code


NOT_UTF8_NOTE = (
    "corral: output that is not UTF-8 is shown as U+FFFD in --json (JSON holds text); "
    "run without --json for its bytes"
)
"""What ``corral run --json`` says on stderr when the output had bytes that are not UTF-8
(in-process and through a server alike)."""


async def _captured(sb: Sandbox, args: argparse.Namespace, command: list[str], env: Any) -> int:
    stdin = sys.stdin.buffer.read() if args.stdin else None
    result = await sb.run(command, timeout=args.timeout, stdin=stdin, env=env, cwd=args.workdir)
    print(json.dumps(result.to_dict()))
    if "\ufffd" in result.stdout or "\ufffd" in result.stderr:
        print(NOT_UTF8_NOTE, file=sys.stderr)
    if result.truncated:
        cap = sb.policy.limits.output_bytes
        print(
            f"corral: output truncated: more than {cap} bytes on a stream, the middle was "
            "cut (raise --output-bytes, or run without --json to stream it all)",
            file=sys.stderr,
        )
    return _status(result.exit_code, result.timed_out)


async def _streamed(sb: Sandbox, args: argparse.Namespace, command: list[str], env: Any) -> int:
    oom_before = sb.oom_kills()
    timeout = args.timeout if args.timeout is not None else sb.policy.limits.exec_timeout_secs
    stream = await sb.exec_stream(
        command,
        stdin="pipe" if args.stdin else None,
        cwd=args.workdir,
        env=env,
        timeout=timeout,
    )
    from corral.streaming import Exited, Stdout

    feeder = _feed_stdin(stream) if args.stdin else None
    # To a terminal, box bytes lose what could drive it (OSC 52, titles, ...); to a pipe or
    # file, and with --raw, they pass byte for byte.
    filters = {fd: _terminal_filter(fd, args) for fd in (1, 2)}
    code = -9
    async with stream:
        try:
            async for event in stream:
                if isinstance(event, Exited):
                    code = event.code
                    continue
                fd = 1 if isinstance(event, Stdout) else 2
                shown = filters[fd]
                data = event.data if shown is None else shown.feed(event.data)
                if not _write_all(fd, data):
                    return EXIT_SIGPIPE  # the reader is gone; leaving `async with` ends it
        finally:
            if feeder is not None:
                feeder.cancel()
    for fd, shown in filters.items():
        if shown is not None:
            _write_all(fd, shown.flush())
    if stream.timed_out:
        print(f"corral: timed out after {timeout or 0:g} s", file=sys.stderr)
    if sb.oom_kills() > oom_before:
        print("corral: the memory limit killed a process (--memory)", file=sys.stderr)
    for line in refusal_lines(sb.network_refusals()):
        print(terminal_safe(line, sys.stderr, args), file=sys.stderr)
    return _status(code, stream.timed_out)


def _terminal_filter(fd: int, args: argparse.Namespace) -> TerminalFilter | None:
    if args.raw or not os.isatty(fd):
        return None
    from corral.output import TerminalFilter

    return TerminalFilter()


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to ``fd`` whole (blocking: a slow reader slows the box, nothing piles
    up here); False when the reader has gone (EPIPE)."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            import select

            select.select([], [fd], [])
            continue
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                return False
            raise
        view = view[n:]
    return True


def _feed_stdin(stream: Any) -> asyncio.Future[None]:
    """Copy corral's stdin to the command as it arrives, then close the command's stdin. A
    daemon thread reads (a terminal never ends; nothing waits for it at exit)."""
    import asyncio
    import concurrent.futures
    import threading

    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)

    def reader() -> None:
        while True:
            try:
                data = os.read(0, CHUNK)
            except OSError:
                data = b""
            try:
                asyncio.run_coroutine_threadsafe(chunks.put(data), loop).result()
            except (RuntimeError, asyncio.CancelledError, concurrent.futures.CancelledError):
                return  # the command is done with its stdin, or corral is ending
            if not data:
                return

    threading.Thread(target=reader, name="corral-stdin", daemon=True).start()

    async def pump() -> None:
        while data := await chunks.get():
            with contextlib.suppress(errors.SandboxError):
                await stream.write(data)
        with contextlib.suppress(errors.SandboxError):
            await stream.close_stdin()

    return asyncio.ensure_future(pump())
