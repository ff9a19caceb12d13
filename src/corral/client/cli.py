"""The CLI's commands through ``corral serve`` (stdlib only: nothing heavy is imported).

- ``corral run`` goes through a reachable server (see :func:`corral.client.fast.locate`):
  the server parses the same flags and runs the command in a box of a warm pool.
- Boxes that outlive one call, as with docker: ``corral create`` (prints an id),
  ``corral exec ID -- CMD``, ``corral ps [ID]``, ``corral cp SRC DST`` (one side
  ``ID:PATH``), ``corral logs ID PID [-f]``, ``corral rm ID...``, and ``corral port ID
  [PORT]`` (expose a box port; prints its host URL and preview URL), ``corral snapshot ID
  NAME`` and ``corral fork ID [-n N]`` (a box on an image: its filesystem kept as an image,
  new boxes from it). These need a server.

Host paths in the flags (``--workspace``, ``--policy``, ``-v HOST:BOX``) are made absolute
here, against this shell's directory, before they reach the server; ``-e NAME`` takes
``NAME``'s value from this environment.
"""

from __future__ import annotations

import errno
import os
import sys

from corral.agent import lean
from corral.client import frames
from corral.client.fast import Conn, ServerError, chunks, locate, q

TYPE_CHECKING = False  # no typing (nor argparse) on `corral run`'s way to the server
if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator, Sequence
    from typing import Any, NoReturn

__all__ = ["SERVER_COMMANDS", "console", "exit_now", "main", "remote_main", "server_parser"]

SERVER_COMMANDS = ("create", "exec", "ps", "cp", "logs", "rm", "port", "snapshot", "fork")
TERMINAL_COMMANDS = ("shell", "attach", "sessions")
"""Commands of the in-process CLI that go through a server when one is running."""
EXIT_USAGE, EXIT_SANDBOX, EXIT_PIPE = 2, 125, 141


class _Usage(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``corral`` command: through a running server when there is one (without
    importing the library or argparse), else :func:`corral.cli.main` in-process."""
    args = list(sys.argv[1:] if argv is None else argv)
    handled = remote_main(args)
    if handled is not None:
        return handled
    from corral.cli import main as local_main

    return local_main(args)


def console() -> NoReturn:
    """The console script: :func:`main`, then :func:`exit_now` with its status (130 on a
    Ctrl-C at any point, the imports included)."""
    _standard_fds()
    try:
        status = main()
    except KeyboardInterrupt:
        status = 130
    exit_now(status)


def _standard_fds() -> None:
    """Started with stdin, stdout or stderr closed (``cmd >&-``), open /dev/null there:
    else the first file or socket corral opens takes that number, and the box's output (or
    its input) goes to it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            name = ("stdin", "stdout", "stderr")[fd]
            if getattr(sys, name) is None:  # the interpreter saw it closed
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


def exit_now(status: int) -> NoReturn:
    """End the process the way the interpreter would, minus its last step.

    Everything a normal exit does that anyone can observe is done here, in the same order:
    other threads are joined (``threading``'s shutdown, which also stops idle thread pools),
    ``atexit`` handlers run, stdout and stderr are flushed (stdout's reader gone: 141, as
    after SIGPIPE; any other failure to flush: 120, the status Python itself exits with
    then). What is left out is the interpreter tearing down every module and object one by
    one, which after a box has run (asyncio, pydantic and the policy's models loaded) took
    ~100 ms of a ~500 ms ``corral run -- true``, and has nothing left to clean up: the box,
    its cgroup and mounts are gone by the time the command returns.
    """
    threading = sys.modules.get("threading")
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except OSError as exc:
            status = EXIT_PIPE if stream is sys.stdout and exc.errno == errno.EPIPE else 120
    os._exit(status)


def _print_json(obj: Any, indent: int | None = None) -> None:
    """What a command prints with ``--json`` (json itself only here: `corral run` through a
    server never imports it, see :mod:`corral.client.fast`)."""
    import json

    print(json.dumps(obj, indent=indent))


def remote_main(argv: Sequence[str]) -> int | None:
    """Handle ``argv`` through a server, or None when the in-process CLI should."""
    if not argv:
        return None
    command, rest = argv[0], list(argv[1:])
    if command == "run" or command in TERMINAL_COMMANDS:
        if any(a in ("-h", "--help") for a in _flags(rest)):
            return None
        try:
            conn = locate()
        except ServerError as exc:
            return _run_error(exc, rest) if command == "run" else _say_error(exc)
        if conn is None:
            return None
        if command == "run":
            return _run_or_fall_back(conn, rest)
        return _guarded(lambda: _terminal(conn, command, rest))
    if command not in SERVER_COMMANDS:
        return None
    try:
        if command == "exec":
            head, tail = _exec_split(rest)
            args = server_parser().parse_args(["exec", *head])
            args.command = tail
        else:
            args = server_parser().parse_args(list(argv))
    except _Usage as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def go() -> int:
        conn = locate()
        if conn is None:
            raise ServerError(
                "server_unavailable",
                f"corral {command} needs a running server: start `corral serve` (or set "
                "CORRAL_HOST to where one listens)",
            )
        result: int = args.func(conn, args)
        return result

    return _guarded(go)


def _run_or_fall_back(conn: Conn, argv: list[str]) -> int | None:
    """``corral run`` through ``conn``; None (run in-process) when the default socket is a
    stale one: nothing answers there and no CORRAL_HOST asked for it."""
    explicit = bool(os.environ.get("CORRAL_HOST", "").strip())
    try:
        return _run(conn, argv)
    except ServerError as exc:
        if exc.code == "server_unavailable" and not explicit and exc.status == 0:
            return None
        return _run_error(exc, argv)
    except BrokenPipeError:
        return 141


def _run_error(exc: ServerError, argv: list[str]) -> int:
    """``corral run``'s error: with ``--json`` the JSON object on stdout, as in-process (a
    script reads stdout; the plain line on stderr left it nothing), else the line."""
    if "--json" not in _flags(argv):
        return _say_error(exc)
    _print_json({"error": {"code": exc.code, "message": exc.message}})
    return EXIT_USAGE if exc.code in USAGE_CODES else EXIT_SANDBOX


def _guarded(call: Any) -> int:
    try:
        return int(call())
    except ServerError as exc:
        return _say_error(exc)
    except BrokenPipeError:
        return 141
    except OSError as exc:  # this host's side (a full disk, a closed terminal): said, not raised
        return _say_error(_host_error(str(exc.filename or "corral"), exc))


def _on_stderr(text: str) -> str:
    """``text`` for stderr: to a terminal without what could drive it (an error message may
    carry what a box or a compromised agent wrote: OSC 52, titles)."""
    if not sys.stderr.isatty():
        return text
    from corral.output import for_terminal

    return for_terminal(text)


USAGE_CODES = frozenset(
    {
        "invalid_input",
        "invalid_policy",
        "box_not_found",
        "process_not_found",
        "session_not_found",
        "path_outside_sandbox",
    }
)
"""Codes of the caller's mistakes (a bad flag, an id that is not there, a path the policy
does not grant: ``corral cp f ID:/etc/x``): exit 2, as a bad command line; anything else is
the server's or the box's failure (125)."""


def _say_error(exc: ServerError) -> int:
    print(_on_stderr(f"corral: [{exc.code}] {exc.message}"), file=sys.stderr)
    return EXIT_USAGE if exc.code in USAGE_CODES else EXIT_SANDBOX


def _flags(args: Sequence[str]) -> Iterator[str]:
    for arg in args:
        if arg == "--":
            return
        yield arg


# ---- paths and variables are this shell's ----------------------------------------------------
_PATH_FLAGS = ("--workspace", "--policy")
_MOUNT_FLAGS = ("-v", "--mount")
_ENV_FLAGS = ("-e", "--env")
_IMAGE_FLAGS = ("--image",)


def localize(argv: list[str]) -> list[str]:
    """``corral run``'s flags with host paths absolute and ``-e NAME`` given its value."""
    out: list[str] = []
    has_workspace = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        name, eq, value = arg.partition("=")
        flags = (*_PATH_FLAGS, *_MOUNT_FLAGS, *_ENV_FLAGS, *_IMAGE_FLAGS)
        if name in flags and (eq or i + 1 < len(argv)):
            if not eq:
                i += 1
                value = argv[i]
            has_workspace = has_workspace or name == "--workspace"
            out += [name, _localized(name, value)]
        elif arg.startswith("-v") and len(arg) > 2 and not arg.startswith("--"):
            out += ["-v", _localized("-v", arg[2:])]
        elif arg.startswith("-e") and len(arg) > 2 and not arg.startswith("--"):
            out += ["-e", _localized("-e", arg[2:])]
        else:
            out.append(arg)
        i += 1
    if not has_workspace:
        out = ["--workspace", os.getcwd(), *out]
    return out


def _localized(flag: str, value: str) -> str:
    if flag in _IMAGE_FLAGS:  # a path here (a layout, an archive, a root), else a ref
        path, sep, tag = value.rpartition(":") if ":" in value else (value, "", "")
        for candidate, suffix in ((value, ""), (path, sep + tag)):
            if candidate and os.path.exists(candidate):
                return os.path.abspath(candidate) + suffix
        return value
    if flag in _PATH_FLAGS:
        return os.path.abspath(os.path.expanduser(value))
    if flag in _MOUNT_FLAGS:
        host, sep, rest = value.partition(":")
        return os.path.abspath(os.path.expanduser(host)) + sep + rest if sep else value
    name, eq, _ = value.partition("=")
    return value if eq else f"{name}={os.environ.get(name, '')}"


# ---- output frames to this terminal ----------------------------------------------------------
def _writer(fd: int, raw: bool) -> Any:
    """A function writing box bytes to ``fd``: byte for byte, except to a terminal (without
    --raw), where what could drive the terminal is dropped as in-process."""
    if raw or not os.isatty(fd):
        return lambda data: _write_all(fd, data)
    from corral.output import TerminalFilter

    shown = TerminalFilter()
    return lambda data: _write_all(fd, shown.feed(data))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _OutputFailed(Exception):
    """This host's stdout or stderr refused the output (told apart from the server's stream
    breaking, which is also an OSError)."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(cause)
        self.cause = cause


def _local(write: Any) -> Any:
    def written(data: bytes) -> None:
        try:
            write(data)
        except OSError as exc:
            raise _OutputFailed(exc) from None

    return written


def _play(response: Any, raw: bool) -> int:
    """Copy a frames response to stdout/stderr; the command's exit status (or 125; 120
    when this host's stdout cannot take it, a full disk say, as in-process)."""
    out, err = _local(_writer(1, raw)), _local(_writer(2, raw))
    try:
        return _played(response, raw, out, err)
    except _OutputFailed as failed:
        if failed.cause.errno == errno.EPIPE:
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
        print(f"corral: cannot write the output: {failed.cause.strerror}", file=sys.stderr)
        return 120


def _played(response: Any, raw: bool, out: Any, err: Any) -> int:
    try:
        for kind, data in frames.FrameReader(response):
            if kind == frames.STDOUT:
                out(data)
            elif kind == frames.STDERR:
                err(data)
            elif kind == frames.NOTE:  # a network refusal may quote what the box sent
                note = data.decode("utf-8", "replace")
                print(note if raw else _on_stderr(note), file=sys.stderr, flush=True)
            elif kind == frames.END:
                end = lean.loads(data)
                return int(end.get("status", end.get("exit_code", 0)))
            elif kind == frames.ERROR:
                error = lean.loads(data)["error"]
                raise ServerError(error["code"], error["message"], 200, error.get("retryable"))
    except (EOFError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        raise ServerError(
            "server_unavailable", f"the server's stream broke off: {exc}", 200, retryable=True
        ) from None
    raise ServerError(
        "server_unavailable", "the server ended the stream early", 200, retryable=True
    )


# ---- corral run --------------------------------------------------------------------------------
def _run(conn: Conn, argv: list[str]) -> int:
    args = localize(argv)
    flags = list(_flags(args))
    stdin = "--stdin" in flags
    raw = "--raw" in flags
    spec = lean.dumps({"argv": args, "stdin": stdin})
    body = chunks(0) if stdin else None
    response = conn.request("POST", "/v1/cli/run", raw=body, headers={"X-Corral-Run": spec})
    return _play(response, raw)


# ---- terminals: shell, attach, sessions through the server -------------------------------------
def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """``flag VALUE`` or ``flag=VALUE`` out of ``argv`` (before ``--``)."""
    rest: list[str] = []
    value = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _terminal(conn: Conn, command: str, argv: list[str]) -> int:
    from corral.client import terminal

    keys, argv = _take(argv, "--detach-keys")
    keys = keys or "ctrl-]"
    if command != "sessions":
        _check_detach_keys(keys)
    if command == "shell":
        shell, flags = _take(argv, "--shell")
        return terminal.shell(conn, localize(flags), shell, keys)
    if command == "attach":
        ids = [a for a in argv if not a.startswith("-")]
        if len(ids) != 1 or len(ids) != len(argv):
            raise ServerError(
                "invalid_input",
                f"corral attach SESSION_ID [--detach-keys KEYS], not {' '.join(argv) or 'nothing'}"
                " (see corral sessions)",
            )
        return terminal.attach(conn, ids[0], keys)
    unknown = [a for a in argv if a not in ("--json", "--raw")]
    if unknown:  # as in-process: a typo is not run as if it were not there
        raise ServerError(
            "invalid_input",
            f"corral sessions: unrecognized arguments: {' '.join(unknown)} (it takes --json)",
        )
    found = terminal.list_sessions(conn)
    if "--json" in argv:
        _print_json(found, indent=2)
        return 0
    if not found:
        print("no attachable sessions")
        return 0
    print(f"{'SESSION':<38} {'BOX':<17} {'SHELL':<14} ATTACHED")
    for s in found:
        print(f"{s['id']:<38} {s['box']:<17} {s['shell']:<14} {s['attached']}")
    return 0


def _check_detach_keys(text: str) -> None:
    """Bad ``--detach-keys`` as one line and status 2, before a box or terminal is touched:
    the parser raises the library's error, which reached the user as a traceback here."""
    from corral import errors
    from corral.sessions.terminal import parse_detach_keys

    try:
        parse_detach_keys(text)
    except errors.SandboxError as exc:
        raise ServerError("invalid_input", exc.message) from None


# ---- commands that need a server -------------------------------------------------------------
_EXEC_VALUED = ("-w", "--workdir", "-e", "--env", "--timeout")
"""``corral exec``'s flags that take the next argument as their value."""


def _exec_split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``corral exec``'s arguments as (its flags and the box id, the command).

    The command is what follows ``--``, or without one, what starts at the first argument
    after the box id that is not a flag: exec's own flags are exec's wherever they are
    before it (``corral exec ID -i -- cat`` as ``corral exec -i ID -- cat``). argparse's
    REMAINDER right after the box took them as the command, which ran ``-i`` (127).
    """
    positionals = 0
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg.startswith("-") and arg != "-":
            i += 2 if arg in _EXEC_VALUED else 1
            continue
        positionals += 1
        if positionals == 2:
            return argv[:i], argv[i:]
        i += 1
    return argv, []


def server_parser() -> argparse.ArgumentParser:
    """The parser of the commands that need a server (create, exec, ps, cp, logs, rm)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise _Usage(f"{self.prog}: {message} (see {self.prog} --help)")

    parser = Parser(prog="corral")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    create = sub.add_parser("create", help="make a box on the server; prints its id")
    create.add_argument("--label", action="append", default=[], metavar="K=V")
    create.add_argument("--ttl", type=float, metavar="SECS", help="close it after SECS")
    create.add_argument("--idle-timeout", type=float, metavar="SECS")
    create.add_argument("flags", nargs=argparse.REMAINDER, help="corral run's sandbox flags")
    create.set_defaults(func=_create)
    ex = sub.add_parser("exec", help="run a command in a box: corral exec ID -- CMD")
    ex.add_argument("box")
    ex.add_argument("-w", "--workdir")
    ex.add_argument("-e", "--env", action="append", default=[], metavar="K=V")
    ex.add_argument("--timeout", type=float)
    ex.add_argument("-i", "--stdin", action="store_true", help="pass stdin to the command")
    ex.add_argument("--raw", action="store_true")
    ex.add_argument("command", nargs="*", help="the command, after --")
    ex.set_defaults(func=_exec)
    ps = sub.add_parser("ps", help="the server's boxes, or a box's processes")
    ps.add_argument("box", nargs="?")
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(func=_ps)
    cp = sub.add_parser(
        "cp", help="copy files or directories in or out: corral cp SRC ID:PATH, ID:PATH DST"
    )
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=_cp)
    logs = sub.add_parser("logs", help="a process's output")
    logs.add_argument("box")
    logs.add_argument("pid", type=int)
    logs.add_argument("-f", "--follow", action="store_true")
    logs.set_defaults(func=_logs)
    rm = sub.add_parser("rm", help="close boxes")
    rm.add_argument("boxes", nargs="+")
    rm.set_defaults(func=_rm)
    port = sub.add_parser(
        "port", help="expose a box port: corral port ID PORT prints its URLs; ID alone lists"
    )
    port.add_argument("box")
    port.add_argument("port", nargs="?", type=int)
    port.add_argument("--host-port", type=int, default=0, help="host 127.0.0.1 port (0: any)")
    port.add_argument("--rm", action="store_true", help="stop exposing PORT")
    port.add_argument("--json", action="store_true")
    port.set_defaults(func=_port)
    keeps = Parser(add_help=False)
    keeps.add_argument("--workspace", action="store_true", help="keep its workspace too")
    keeps.add_argument(
        "--processes",
        choices=("warn", "error"),
        default="warn",
        help="processes running whose state cannot be kept: warn (the default) or fail",
    )
    keeps.add_argument("--json", action="store_true")
    snap = sub.add_parser(
        "snapshot", parents=[keeps], help="a box's filesystem as an image: prints its ref"
    )
    snap.add_argument("box")
    snap.add_argument("name", help="the image's ref, e.g. localhost/task/step:1")
    snap.set_defaults(func=_snapshot)
    fork = sub.add_parser(
        "fork", parents=[keeps], help="new boxes from a box's filesystem: prints their ids"
    )
    fork.add_argument("box")
    fork.add_argument("-n", type=int, default=1, help="how many (default 1)")
    fork.add_argument("--label", action="append", default=[], metavar="K=V")
    fork.set_defaults(func=_fork)
    return parser


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"corral: warning: {warning}", file=sys.stderr)


def _snapshot(conn: Conn, args: argparse.Namespace) -> int:
    body = {"name": args.name, "processes": args.processes, "workspace": args.workspace}
    snap = conn.json("POST", f"/v1/boxes/{q(args.box)}/snapshot", body)
    if args.json:
        _print_json(snap)
        return 0
    _warn(snap.get("warnings", []))
    print(snap["ref"])
    return 0


def _fork(conn: Conn, args: argparse.Namespace) -> int:
    labels = _labels(args.label)
    body = {
        "n": args.n,
        "labels": labels,
        "processes": args.processes,
        "workspace": args.workspace,
    }
    boxes = conn.json("POST", f"/v1/boxes/{q(args.box)}/fork", body)
    if args.json:
        _print_json(boxes)
        return 0
    _warn(boxes[0].get("warnings", []) if boxes else [])
    for box in boxes:
        print(box["id"])
    return 0


def _labels(items: list[str]) -> dict[str, str]:
    """``--label K=V`` flags as a dict; ``nolabel`` or ``=x`` refused (they became a label
    ``nolabel=`` and an empty key), before anything is made."""
    labels: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ServerError("invalid_input", f"--label {item!r}: give KEY=VALUE, e.g. job=t1")
        labels[key] = value
    return labels


def _create(conn: Conn, args: argparse.Namespace) -> int:
    flags = [f for f in args.flags if f != "--"]
    labels = _labels(args.label)
    body: dict[str, Any] = {"cli_argv": localize(flags), "labels": labels}
    if args.ttl is not None:
        body["ttl_secs"] = args.ttl
    if args.idle_timeout is not None:
        body["idle_timeout_secs"] = args.idle_timeout
    box = conn.json("POST", "/v1/boxes", body)
    for warning in box.get("warnings", []):
        print(f"corral: warning: {warning}", file=sys.stderr)
    print(box["id"])
    return 0


def _exec(conn: Conn, args: argparse.Namespace) -> int:
    command = list(args.command)
    if not command:
        raise ServerError("invalid_input", "give a command after --, e.g. corral exec ID -- ls")
    query = "&".join(f"cmd={q(c)}" for c in command)
    for item in args.env:
        query += f"&env={q(_localized('-e', item))}"
    if args.workdir:
        query += f"&cwd={q(args.workdir)}"
    if args.timeout is not None:
        query += f"&timeout={args.timeout}"
    if args.stdin:
        query += "&stdin=true"
    body = chunks(0) if args.stdin else None
    response = conn.request("POST", f"/v1/boxes/{q(args.box)}/exec?{query}", raw=body)
    return _play(response, args.raw)


def _ps(conn: Conn, args: argparse.Namespace) -> int:
    if args.box:
        rows = conn.json("GET", f"/v1/boxes/{q(args.box)}/processes")
        if args.json:
            _print_json(rows)
            return 0
        print(f"{'PID':>7}  {'STATUS':<9} {'EXIT':>4}  COMMAND")
        for p in rows:
            code = "" if p["exit_code"] is None else str(p["exit_code"])
            print(f"{p['pid']:>7}  {p['status']:<9} {code:>4}  {p['command']}")
        return 0
    boxes = conn.json("GET", "/v1/boxes")
    if args.json:
        _print_json(boxes)
        return 0
    print(f"{'ID':<17} {'STATE':<8} {'BACKEND':<8} {'NETWORK':<9} {'PROCS':>5}  LABELS")
    for b in boxes:
        labels = ",".join(f"{k}={v}" for k, v in b["labels"].items())
        print(
            f"{b['id']:<17} {b['state']:<8} {b['backend']:<8} {b['network']:<9} "
            f"{b['processes']:>5}  {labels}"
        )
    return 0


def _split_ref(ref: str) -> tuple[str, str] | None:
    box, sep, path = ref.partition(":")
    if sep and box.startswith("box-") and "/" not in box:
        return box, path
    return None


def _cp(conn: Conn, args: argparse.Namespace) -> int:
    """``corral cp SRC ID:PATH`` and ``corral cp ID:PATH DST``: files and directories (as
    ``docker cp``: into an existing directory, else as that name), ``-`` for stdin/stdout.
    Symbolic links and special files inside a copied directory are skipped and named on
    stderr; named as the source themselves, they are refused. Copying out, no link on the
    host side is written through or read through (:class:`_HostPath`)."""
    src, dst = _split_ref(args.src), _split_ref(args.dst)
    if (src is None) == (dst is None):
        raise ServerError(
            "invalid_input", "one side of corral cp must be ID:PATH and the other a host path"
        )
    copy = _Copy(conn)
    if dst is not None:  # in
        copy.into(dst[0], args.src, dst[1])
    else:
        assert src is not None
        copy.out_of(src[0], src[1], args.dst)
    for skipped in copy.skipped:
        print(_on_stderr(f"corral: cp: skipped {skipped}"), file=sys.stderr)
    return 0


class _Copy:
    """The requests of one ``corral cp``."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.skipped: list[str] = []

    def _stat(self, box: str, path: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.conn.json(
                "GET", f"/v1/boxes/{q(box)}/files/stat?path={q(path)}"
            )
        except ServerError as exc:
            if exc.code == "file_not_found":
                return None
            raise
        return found

    def _put(self, box: str, path: str, body: Iterator[bytes]) -> None:
        url = f"/v1/boxes/{q(box)}/files/content?path={q(path)}"
        self.conn.request("PUT", url, raw=body).read()

    # -- in ----------------------------------------------------------------------------------
    def into(self, box: str, host: str, path: str) -> None:
        if host == "-":
            self._put(box, path, chunks(0, 1 << 20))
            return
        # Looked at before anything is sent, following no link in any component (SRC may be
        # in the box's workspace): a link the box planted there, named as SRC, walked the
        # host directory it points to and made its tree of names in the box.
        source = _HostPath(host)
        if os.path.islink(host):  # named on its own: the user's mistake, or the box's plant
            raise ServerError(
                "invalid_input",
                f"{host} is a symbolic link: corral cp copies regular files and directories "
                "and goes through no link on this host (a box can plant one in its "
                "workspace); name the real path",
            )
        try:
            top = source.open(source.parts, os.O_PATH | os.O_CLOEXEC)  # no side effect
        except OSError as exc:
            raise _host_error(host, exc) from None
        try:
            info = os.fstat(top)
            if not (_is_dir(info) or _is_regular(info)):  # named on its own: refused
                raise ServerError(
                    "invalid_input",
                    f"{host} is not a regular file or directory (a special file): corral cp "
                    "copies regular files and directories",
                )
            found = self._stat(box, path)
            if (found is not None and found["type"] == "dir") or path.endswith("/"):
                path = _join(path, os.path.basename(os.path.normpath(host)))
            if not _is_dir(info):
                self._put_file(box, host, path)
                return
            # Through the directory's fd, no link followed (a link inside is a file to
            # skip, named on stderr, as a FIFO is).
            for rel, _, files, _ in os.fwalk(".", dir_fd=top, onerror=_raise_host_error):
                rel = os.path.normpath(rel)
                here = path if rel == "." else _join(path, *rel.split(os.sep))
                self.conn.request("POST", f"/v1/boxes/{q(box)}/files/mkdir?path={q(here)}").read()
                for name in sorted(files):
                    self._put_file(box, os.path.join(host, rel, name), _join(here, name))
        finally:
            os.close(top)

    def _put_file(self, box: str, host: str, path: str) -> None:
        info = _host_stat(host, follow=False)
        if not _is_regular(info):
            self.skipped.append(f"{host} (not a regular file or directory)")
            return
        # Through no link in any component, as copying out: the file may be in the box's
        # workspace, where a planted `sub -> /etc` would hand the box a host file.
        source = _HostPath(host)
        try:
            fd = source.open(source.parts, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise _host_error(host, exc) from None
        try:
            if not _is_regular(os.fstat(fd)):  # swapped for a FIFO or device meanwhile
                self.skipped.append(f"{host} (not a regular file or directory)")
                return
            os.set_blocking(fd, True)
            self._put(box, path, chunks(fd, 1 << 20))
        finally:
            os.close(fd)

    # -- out ---------------------------------------------------------------------------------
    def out_of(self, box: str, path: str, host: str) -> None:
        found = self._stat(box, path)
        if found is None:
            raise ServerError("file_not_found", f"{box}:{path}: no such file or directory")
        kind = found["type"]
        if host == "-":
            if kind != "file":
                raise ServerError(
                    "invalid_input", f"{box}:{path} is {_a(kind)}: only a file goes to stdout"
                )
            self._get_file(box, path, None)
            return
        dest = _HostPath(host)
        names: tuple[str, ...] = ()
        name = _box_basename(path)
        if dest.is_dir(()) and name not in ("", "."):  # ID:dir/. copies what is in it
            if name == "..":
                raise ServerError("invalid_input", f"{box}:{path}: name what to copy, not ..")
            names = (_safe_name(name),)
        if kind == "file":
            self._get_file(box, path, (dest, names))
        elif kind == "dir":
            self._get_dir(box, path, dest, names)
        else:  # named on its own: refused (inside a copied directory it is skipped)
            raise ServerError(
                "invalid_input",
                f"{box}:{path} is {_a(kind)}: corral cp copies regular files and directories",
            )

    def _get_dir(self, box: str, path: str, dest: _HostPath, names: tuple[str, ...]) -> None:
        todo = [(path, names)]
        while todo:
            path, names = todo.pop()
            dest.mkdir(names)
            entries = self.conn.json("GET", f"/v1/boxes/{q(box)}/files?path={q(path)}")
            for entry in entries:
                name = str(entry.get("name", ""))
                child, below = _join(path, name), (*names, _safe_name(name))
                if entry.get("type") == "dir":
                    todo.append((child, below))
                elif entry.get("type") == "file":
                    self._get_file(box, child, (dest, below))
                else:
                    self.skipped.append(f"{box}:{child} ({_a(str(entry.get('type')))})")

    def _get_file(
        self, box: str, path: str, host: tuple[_HostPath, tuple[str, ...]] | None
    ) -> None:
        url = f"/v1/boxes/{q(box)}/files/content?path={q(path)}"
        response = self.conn.request("GET", url)
        if host is None:
            while data := response.read(1 << 20):
                _write_all(1, data)
            return
        fd = host[0].create(host[1])
        try:
            while data := response.read(1 << 20):
                _write_all(fd, data)
        finally:
            os.close(fd)


class _HostPath:
    """A host path ``corral cp`` reads (copying in) or writes (copying out), walked following
    no symbolic link.

    The path is often in the box's own workspace (``corral create`` shares this directory),
    so the box chose what its components are: a link it planted (``sub -> /etc/cron.d``)
    must not take a write, or hand the box a read, made here as the user (often root) out
    of the place the user named. Every component of the path as spelled (below this
    directory for a relative path, below ``/`` for an absolute one; leading ``..`` are the
    user's) and every name below it is opened one at a time with ``O_NOFOLLOW`` relative to
    the directory before it (:func:`corral.agent.files.open_beneath`), directories are made
    by that directory's fd, and a link anywhere is refused in one line naming it.
    """

    def __init__(self, spelled: str) -> None:
        self.spelled = spelled
        path = os.path.normpath(spelled)
        if os.path.isabs(path):
            self.anchor, rel = "/", path.lstrip("/")
        else:
            parts = path.split("/")
            ups = 0
            while ups < len(parts) and parts[ups] == "..":
                ups += 1
            self.anchor, rel = "/".join(parts[:ups]) or ".", "/".join(parts[ups:])
        self.parts = tuple(p for p in rel.split("/") if p not in ("", "."))

    def shown(self, names: tuple[str, ...]) -> str:
        return os.path.join(self.spelled, *names)

    def open(self, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
        """``parts`` (below the anchor) opened following no link: a link is refused."""
        from corral.agent.files import open_beneath

        try:
            anchor = os.open(self.anchor, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise _host_error(self.anchor, exc) from None
        try:
            return open_beneath(anchor, "/".join(parts) or ".", flags, mode, no_symlinks=True)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_refused(parts) from None
            raise
        finally:
            os.close(anchor)

    def _link_refused(self, parts: tuple[str, ...]) -> ServerError:
        """The refusal, naming the first component that is a link (looked at, not opened)."""
        where, walked = self.spelled, self.anchor
        for part in parts:
            walked = os.path.join(walked, part)
            if os.path.islink(walked):
                where = walked
                break
        return ServerError(
            "file_error",
            f"{where} is a symbolic link: corral cp goes through no link on this host (a "
            "box can plant one in its workspace); name the real path",
        )

    def is_dir(self, names: tuple[str, ...]) -> bool:
        """Whether DEST/names is a directory (a link there is refused, not followed)."""
        try:
            os.close(self.open((*self.parts, *names), os.O_PATH | os.O_DIRECTORY))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise _host_error(self.shown(names), exc) from None
        return True

    def mkdir(self, names: tuple[str, ...]) -> None:
        """DEST/names as a directory, made by its parent's fd when it is not there."""
        parts = (*self.parts, *names)
        try:
            if parts:
                parent = self.open(parts[:-1], os.O_PATH | os.O_DIRECTORY)
                try:
                    os.mkdir(parts[-1], 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
                finally:
                    os.close(parent)
            os.close(self.open(parts, os.O_PATH | os.O_DIRECTORY))  # a directory, no link
        except OSError as exc:
            raise _host_error(self.shown(names), exc) from None

    def create(self, names: tuple[str, ...]) -> int:
        """DEST/names opened to be written (made, or emptied when it is a regular file):
        never through a link, never a FIFO or device to block on or write to."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK
        try:
            fd = self.open((*self.parts, *names), flags, 0o644)
        except OSError as exc:
            raise _host_error(self.shown(names), exc) from None
        try:
            if os.fstat(fd).st_mode & 0o170000 != 0o100000:
                raise ServerError(
                    "file_error", f"{self.shown(names)}: not a regular file (on this host)"
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _a(kind: str) -> str:
    """A box file's type as words: the API's ``other`` (a FIFO, socket or device) read
    "is a other"."""
    return {
        "dir": "a directory",
        "symlink": "a symbolic link",
        "other": "a special file (a FIFO, socket or device)",
    }.get(kind, f"a {kind}")


def _join(path: str, *names: str) -> str:
    """A box path and names below it (``/`` is the box's separator)."""
    return "/".join([path.rstrip("/") or ("/" if path.startswith("/") else "."), *names])


def _box_basename(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def _safe_name(name: str) -> str:
    """A name the box listed, as one host path component: a hostile box's ``..``, ``a/b``
    or NUL must not lead a copy out of its target."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ServerError("protocol_error", f"the box listed a file named {name!r}: refused")
    return name


def _host_stat(path: str, follow: bool = True) -> os.stat_result:
    try:
        return os.stat(path) if follow else os.lstat(path)
    except OSError as exc:
        raise _host_error(path, exc) from None


def _is_dir(info: os.stat_result) -> bool:
    return info.st_mode & 0o170000 == 0o040000


def _is_regular(info: os.stat_result) -> bool:
    return info.st_mode & 0o170000 == 0o100000


def _raise_host_error(exc: OSError) -> None:
    raise _host_error(str(exc.filename), exc)


def _host_error(path: str, exc: OSError) -> ServerError:
    """An error of this host's files, said as the box's are (a code and a sentence)."""
    import errno

    code = {
        errno.ENOENT: "file_not_found",
        errno.EISDIR: "is_a_directory",
        errno.ENOTDIR: "not_a_directory",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
    }.get(exc.errno or 0, "file_error")
    return ServerError(code, f"{path}: {exc.strerror or exc} (on this host)")


def _logs(conn: Conn, args: argparse.Namespace) -> int:
    base = f"/v1/boxes/{q(args.box)}/processes/{args.pid}"
    if args.follow:
        return _play(conn.request("GET", f"{base}/follow"), raw=False)
    cut = False
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        response = conn.request("GET", f"{base}/output?stream={stream}")
        _write_all(fd, response.read())
        cut = cut or response.headers.get("x-corral-truncated") == "1"
    if cut:  # the same line as the server's note to `logs -f`
        print(
            f"corral: output truncated: over {args.box}'s output cap (--output-bytes) the "
            "middle of a stream was cut; to keep it all, redirect the command's output to a "
            "file in the box and copy it out (corral cp)",
            file=sys.stderr,
        )
    return 0


def _rm(conn: Conn, args: argparse.Namespace) -> int:
    status = 0
    for box in args.boxes:
        try:
            conn.request("DELETE", f"/v1/boxes/{q(box)}").read()
        except ServerError as exc:  # said, and the next box is still closed
            status = max(status, _say_error(exc))
    return status


def _port(conn: Conn, args: argparse.Namespace) -> int:
    """``corral port ID PORT``: expose it and print ``URL  PREVIEW_URL``; ``ID``: every
    exposed port, one a line; ``--rm``: stop exposing PORT."""
    base = f"/v1/boxes/{q(args.box)}/ports"
    if args.rm:
        if args.port is None:
            raise ServerError("invalid_input", "which port? corral port ID PORT --rm")
        conn.request("DELETE", f"{base}/{args.port}").read()
        return 0
    if args.port is None:
        ports = conn.json("GET", base)
    else:
        ports = [conn.json("POST", base, {"port": args.port, "host_port": args.host_port})]
    host = f"[{conn.host}]" if ":" in conn.host else conn.host
    server = "" if conn.unix is not None else f"http://{host}:{conn.port}"
    for p in ports:
        p["preview_url"] = server + p["preview_path"]
        if args.json:
            _print_json(p)
        else:
            print(f"{p['port']}\t{p['url']}\t{p['preview_url']}")
    return 0
