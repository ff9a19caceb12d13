"""``corral audit``: show a sandbox audit log, one line per record (registered by corral.cli).

::

    corral audit /var/log/corral/audit.jsonl         # every record so far, pretty
    corral audit --policy corral.toml --follow       # the policy's log, then new records live
    corral audit --json PATH | jq .                  # the records as they are (JSON lines)

The log is JSONL written by :mod:`corral.audit`; lines that are not JSON objects (a torn
last line while a writer is busy cannot happen, but a hand-edited file can) are shown as
``?`` lines rather than stopping the output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from corral.cli.options import add_raw_option, terminal_safe

__all__ = ["format_record", "register"]

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]

POLL_SECONDS = 0.1
"""How often ``--follow`` looks for new lines (stdlib has no portable file watch)."""

# The fields shown first for each kind, in this order; the rest follow as key=value.
_LEADING: dict[str, tuple[str, ...]] = {
    "command": ("event", "pid", "argv", "exit_code"),
    "tool": ("tool", "error"),
    "approval": ("decision", "tool", "command"),
    "file_denied": ("op", "path"),
    "network": ("decision", "host", "port"),
    "violation": ("type",),
    "sandbox": ("event",),
}
_SKIP = frozenset({"ts", "sandbox", "kind"})


def register(sub: SubParsers) -> None:
    p = sub.add_parser("audit", help="show a sandbox audit log (policy.audit_log)")
    p.add_argument("path", nargs="?", metavar="PATH", help="the audit log (a JSONL file)")
    p.add_argument("--policy", metavar="FILE", help="read the log path from this policy")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    p.add_argument("--json", action="store_true", help="print the JSON lines unchanged")
    add_raw_option(p)
    p.set_defaults(func=cmd_audit)


def _log_path(args: argparse.Namespace) -> Path | None:
    if args.path:
        return Path(args.path)
    if args.policy:
        from corral.policy import Policy

        return Policy.load(args.policy).audit_log
    return None


def cmd_audit(args: argparse.Namespace) -> int:
    path = _log_path(args)
    if path is None:
        why = "the policy sets no audit_log" if args.policy else "give a PATH or --policy FILE"
        print(f"corral audit: {why}", file=sys.stderr)
        return 2
    if not args.follow and not path.exists():
        print(f"corral audit: no audit log at {path}", file=sys.stderr)
        return 1
    if path.is_dir():
        print(
            f"corral audit: {path} is a directory; give the audit log file (the policy's "
            "audit_log)",
            file=sys.stderr,
        )
        return 2
    show: Callable[[str], str] = (lambda line: line) if args.json else format_line
    try:
        for line in _lines(path, follow=args.follow):
            print(terminal_safe(show(line), sys.stdout, args), flush=args.follow)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `corral audit | head`
        sys.stderr.close()
        return 0
    return 0


def _lines(path: Path, *, follow: bool) -> Iterator[str]:
    """Complete lines of the log; with ``follow``, wait for more (and survive rotation)."""
    stream: IO[bytes] | None = None
    pending = b""
    try:
        while True:
            if stream is None:
                try:
                    stream = path.open("rb")
                except FileNotFoundError:
                    if not follow:
                        return
                    time.sleep(POLL_SECONDS)
                    continue
            chunk = stream.read(1 << 16)
            if chunk:
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for raw in complete:
                    if raw.strip():
                        yield raw.decode(errors="replace")
                continue
            if not follow:
                if pending.strip():
                    yield pending.decode(errors="replace")
                return
            if _replaced(path, stream):
                stream.close()
                stream, pending = None, b""
                continue
            time.sleep(POLL_SECONDS)
    finally:
        if stream is not None:
            stream.close()


def _replaced(path: Path, stream: IO[bytes]) -> bool:
    """The file was rotated (another inode at the path) or truncated under us."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(stream.fileno())
    return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev) or now.st_size < stream.tell()


def format_line(line: str) -> str:
    try:
        record = json.loads(line)
    except ValueError:
        return f"? {line}"
    if not isinstance(record, dict):
        return f"? {line}"
    return format_record(record)


def format_record(record: dict[str, Any]) -> str:
    """``2025-01-02 10:00:00.123 cb-1a2b3c command spawn pid=7 argv='sh -c ls' ...``"""
    ts = record.get("ts")
    when = (
        datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if isinstance(ts, int | float) and not isinstance(ts, bool)
        else "-"
    )
    kind = str(record.get("kind", "?"))
    parts = [when, str(record.get("sandbox", "-")), kind]
    leading = _LEADING.get(kind, ())
    for key in leading:
        if key in record and record[key] is not None:
            value = record[key]
            parts.append(_value(value) if key in ("event", "type") else f"{key}={_value(value)}")
    for key, value in record.items():
        if key in _SKIP or key in leading or value is None:
            continue
        parts.append(f"{key}={_value(value)}")
    return " ".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        import shlex

        return repr(shlex.join(value))
    if isinstance(value, str):
        text = value if len(value) <= 200 else value[:200] + "..."
        return text if text and text.isprintable() and " " not in text else repr(text)
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value, default=str, separators=(",", ":"))
