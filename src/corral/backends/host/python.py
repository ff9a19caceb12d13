"""The interpreter that runs the guest agent."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from corral import errors
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


HOST_PREFIX = "/run/corral/host"
"""Where a box on an image sees the host's ``/usr``, read-only: the agent's interpreter, its
standard library and the shared libraries they link (the image may have no Python at all)."""


@dataclass(frozen=True, slots=True)
class HiddenPython:
    """How the guest agent runs on an image's root: the host's ``/usr`` bound at
    :data:`HOST_PREFIX`, and the interpreter started by the host's own dynamic loader (the
    image's, if any, is never used), which finds its standard library from its own path."""

    usr: str
    """The host directory bound at ``HOST_PREFIX/usr``."""
    argv: tuple[str, ...]
    """The start of the agent's command line (loader, its library path, interpreter)."""


_LDD = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


@functools.cache
def hidden_python(python: str) -> HiddenPython:
    """:class:`HiddenPython` for ``python``; BackendUnavailable when it or a library it
    links lies outside ``/usr`` (a host without a merged ``/usr``)."""
    real = os.path.realpath(python)
    try:
        out = subprocess.run(
            ["ldd", real], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise errors.BackendUnavailable(f"cannot list the libraries of {real}: {exc}") from None
    libs = [os.path.realpath(m.group(1)) for m in map(_LDD.search, out.splitlines()) if m]
    loader = next((lib for lib in libs if os.path.basename(lib).startswith("ld-linux")), None)
    outside = [p for p in (real, *libs) if not p.startswith("/usr/")]
    if loader is None or outside:
        raise errors.BackendUnavailable(
            f"an image root needs the agent's interpreter and its libraries under /usr "
            f"(a merged /usr); {', '.join(outside) or 'no dynamic loader'} is not"
        )
    dirs = sorted({os.path.dirname(lib) for lib in libs})
    return HiddenPython(
        usr="/usr",
        argv=(
            HOST_PREFIX + loader,
            "--library-path",
            ":".join(HOST_PREFIX + d for d in dirs),
            HOST_PREFIX + real,
        ),
    )
