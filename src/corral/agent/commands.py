"""Starting a command: its rlimits, its terminal, and a clear sentence when it cannot start."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any


def spawn_error(exc: OSError, program: str, cwd: str | None) -> str:
    target = "working directory " + str(cwd) if cwd and exc.filename == cwd else program
    if isinstance(exc, FileNotFoundError):
        return f"{target}: not found" + ("" if target != program else " (check PATH)")
    if isinstance(exc, PermissionError):
        return f"{target}: permission denied"
    return f"cannot start {program}: {exc.strerror or exc}"


def set_winsize(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


RLIMIT_NAMES = {
    "nofile": "RLIMIT_NOFILE",
    "fsize": "RLIMIT_FSIZE",
    "core": "RLIMIT_CORE",
    "nproc": "RLIMIT_NPROC",
    "as": "RLIMIT_AS",
    "cpu": "RLIMIT_CPU",
    "stack": "RLIMIT_STACK",
    "data": "RLIMIT_DATA",
    "memlock": "RLIMIT_MEMLOCK",
}


def set_inherited_rlimits(limits: dict[str, int]) -> dict[str, int]:
    """Set soft and hard limits on the agent itself, for its children to inherit."""
    import resource

    applied = {}
    for name, value in limits.items():
        try:
            resource.setrlimit(getattr(resource, RLIMIT_NAMES[name]), (value, value))
        except (OSError, ValueError):
            continue
        applied[name] = value
    return applied


def make_preexec(rlimits: dict[str, int], use_pty: bool) -> Any:
    """A pre-exec hook only when needed: it costs a Python-level call in the child."""
    if not rlimits and not use_pty:
        return None
    import resource

    limits = [(getattr(resource, RLIMIT_NAMES[k]), v) for k, v in rlimits.items()]

    def preexec() -> None:
        for res, value in limits:
            resource.setrlimit(res, (value, value))
        if use_pty:
            import fcntl
            import termios

            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    return preexec


def drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
