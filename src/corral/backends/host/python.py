"""The interpreter that runs the guest agent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from corral.backends.host.threads import blocking


def find_python() -> str:
    """The real interpreter for the agent: Debian's, never a pyenv shim (80 ms vs 18 ms)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


_compiled: set[str] = set()


async def ensure_agent_compiled(agent_dir: Path, python: str) -> None:
    """:func:`compile_agent`, off the event loop, the first time only."""
    if f"{agent_dir}:{python}" not in _compiled:
        await blocking(compile_agent, agent_dir, python)


def compile_agent(agent_dir: Path, python: str) -> None:
    """Write the ``.pyc`` of every module of the guest agent (once per process; blocking).

    The box's read-only view of the agent cannot get a ``__pycache__`` from inside, so a
    module the host never imported was compiled from source at every box start (8-20 ms
    for the whole agent here). Done only when ``python`` is this interpreter's version
    (the cache tag must match); otherwise the box compiles as before."""
    key = f"{agent_dir}:{python}"
    if key in _compiled:
        return
    _compiled.add(key)
    if os.path.basename(python) != f"python{sys.version_info[0]}.{sys.version_info[1]}":
        return
    import compileall

    compileall.compile_dir(agent_dir, quiet=2)
