"""The audit log: one JSON object per line for everything a sandbox did or was refused.

Each record has ``ts`` (Unix time), ``sandbox`` (the box id), ``kind`` and kind-specific
fields. Kinds: ``sandbox`` (start/close), ``command``, ``tool``, ``approval``, ``file_denied``,
``network``, ``violation`` (seccomp kill, OOM, pids limit). The file is opened in append
mode and every record is written with a single ``write``, so concurrent sandboxes sharing one
log never interleave their lines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.backends.host.safepath import open_regular
from corral.policy import Policy

AuditKind = str


AuditListener = Callable[[dict[str, Any]], None]


class AuditLog:
    """Appends records for one sandbox; a log with no path and no listener records nothing
    (cheaply). Listeners (``corral serve``'s live audit stream) get every record too."""

    def __init__(self, path: Path | None, sandbox_id: str) -> None:
        self.path = path
        self.sandbox_id = sandbox_id
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._listeners: list[AuditListener] = []

    @classmethod
    def for_policy(cls, policy: Policy, sandbox_id: str) -> AuditLog:
        return cls(policy.audit_log, sandbox_id)

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self._listeners)

    def listen(self, listener: AuditListener) -> Callable[[], None]:
        """Call ``listener`` with every record from now on; returns the way to stop."""
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop

    def record(self, kind: AuditKind, **fields: Any) -> None:
        """Append one record. Never raises: auditing must not break the sandbox."""
        if not self.enabled:
            return
        entry = {"ts": round(time.time(), 6), "sandbox": self.sandbox_id, "kind": kind, **fields}
        for listener in tuple(self._listeners):
            try:
                listener(entry)
            except Exception:  # a listener's failure is its own
                pass
        if self.path is None:
            return
        line = (json.dumps(entry, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    # No link as the file, no FIFO: only a regular file is appended to.
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
                    self._fd = open_regular(self.path, flags, 0o600)
                os.write(self._fd, line)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every well-formed record of a log (malformed lines are skipped)."""
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records
