"""A real ``corral serve`` in a subprocess, for the tests, the docs' examples and bench/.

Its runtime directory (token files, the default socket) is a private temporary one, so the
user's own default socket, which every ``corral run`` would go through, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CORRAL = [sys.executable, "-m", "corral"]
START_TIMEOUT = 60.0


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    token: str | None
    runtime: Path
    log: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a CLI that uses this server."""
        env = {**os.environ, "CORRAL_HOST": self.url, "XDG_RUNTIME_DIR": str(self.runtime)}
        env.pop("CORRAL_TOKEN", None)
        if self.token:
            env["CORRAL_TOKEN"] = self.token
        return env

    @property
    def socket(self) -> str:
        assert self.url.startswith("unix:")
        return self.url[5:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code


def start(runtime: Path, *args: str) -> Served:
    """Start ``corral serve ARGS`` and wait (bounded) for its "listening on" line."""
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("CORRAL_HOST", None)
    env.pop("CORRAL_TOKEN", None)
    # Unbuffered: a line read must not pull the next one into a buffer select() cannot see
    # (the server prints its dashboard URL and its address at once).
    proc = subprocess.Popen(
        [*CORRAL, "serve", *args],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        bufsize=0,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + START_TIMEOUT
    log: list[str] = []
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, left))
        if not ready:
            proc.kill()
            raise AssertionError(f"corral serve did not say it listens: {log}")
        line = proc.stderr.readline().decode()
        if not line:
            raise AssertionError(f"corral serve exited {proc.wait()}: {log}")
        log.append(line)
        found = re.search(r"listening on (\S+) \((.*)\)", line)
        if found:
            break
    url, how = found.group(1), found.group(2)
    token = None
    token_file = re.search(r"token in (\S+?)(;|$)", how)
    if token_file:
        token = Path(token_file.group(1)).read_text().strip()
    return Served(proc, url, token, runtime, log)


@contextlib.contextmanager
def serving(runtime: Path, *args: str) -> Iterator[Served]:
    served = start(runtime, *args)
    try:
        yield served
    finally:
        served.stop()
