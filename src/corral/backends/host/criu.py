"""Whether a box's processes could be checkpointed here (CRIU), asked once per process.

A snapshot keeps a box's filesystem; keeping its running processes and their memory on the
namespace backends takes CRIU (Debian's ``criu``), which needs kernel support it checks
itself with ``criu check``. On this project's reference host (Linux 6.18, Debian's criu
3.17.1) that check fails before it starts ("Unexpected rt vDSO area bounds": criu 3.17
predates the kernel's vDSO layout). corral does not checkpoint processes through CRIU yet
(nothing of it is built or tested): :func:`process_state_unavailable` says why, naming what
``criu check`` said, so a snapshot can warn or refuse with the reason.
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess

_CANDIDATES = ("/usr/sbin/criu", "/sbin/criu")
"""Where Debian puts it, should ``PATH`` lack ``/usr/sbin``."""


@functools.cache
def criu_check() -> tuple[bool, str]:
    """``(passes, what it said)``: ``criu check`` run once (as this process's user)."""
    criu = shutil.which("criu") or next((p for p in _CANDIDATES if shutil.which(p)), None)
    if criu is None:
        return False, "criu is not installed (apt-get install criu)"
    try:
        done = subprocess.run(
            [criu, "check"],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`criu check` did not run ({exc})"
    said = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    if done.returncode == 0:
        return True, said[-1] if said else "Looks good."
    errors = [line for line in said if line.startswith("Error")]
    first = (errors or said or [f"exit status {done.returncode}"])[0]
    # "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds" -> the sentence
    detail = first.split("): ", 1)[-1] if first.startswith("Error (") else first
    return False, f"`criu check` fails on this kernel (Linux {platform.release()}): {detail}"


def process_state_unavailable(backend: str) -> str:
    """Why a snapshot of a box on ``backend`` cannot keep its processes (a sentence)."""
    if backend not in ("bwrap", "auto"):
        return f"the {backend} backend has no process checkpointing in corral"
    passes, said = criu_check()
    if not passes:
        return f"process state needs CRIU, and {said}"
    return (
        f"`criu check` passes here ({said}), but corral does not checkpoint processes "
        "through CRIU yet"
    )
