"""Directories a box must not get as its workspace, for the library, the CLI and the MCP
server alike.

A box may create, change and delete anything in its workspace. ``/``, the host's system
directories and home directories (keys, tokens, shell startup files) are therefore refused
unless the caller says so explicitly (``Sandbox(..., allow_dangerous_workspace=True)``,
``corral run --force-workspace``, ``corral mcp --force-workspace``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
from pathlib import Path

from corral.errors import DangerousWorkspace

__all__ = ["refuse_dangerous_workspace", "workspace_danger"]

# The host's system trees: neither they nor anything inside them is a workspace.
_SYSTEM_TREES = (
    "/etc",
    "/usr",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/var/lib",
    "/var/log",
    "/var/cache",
    "/var/spool",
    "/var/backups",
    "/var/mail",
)
# Directories that hold other people's data: refused themselves, their subdirectories are fine.
_SYSTEM_DIRS = (
    "/var",
    "/var/tmp",
    "/run",
    "/srv",
    "/opt",
    "/tmp",
    "/mnt",
    "/media",
    "/home",
    "/root",
)


# Dot directories of a home whose subdirectories are as secret as they are.
_KEY_STORES = (".ssh", ".gnupg", ".aws", ".kube", ".docker", ".password-store")


def _homes() -> set[str]:
    homes = {os.path.realpath(os.path.expanduser("~")), "/root"}
    with contextlib.suppress(OSError):
        for entry in pwd.getpwall():
            if entry.pw_dir.startswith("/home/") or entry.pw_uid >= 1000:
                homes.add(os.path.realpath(entry.pw_dir))
    homes.update(str(p) for p in Path("/home").glob("*") if p.is_dir())
    return {h for h in homes if h not in ("/", "/nonexistent")}


def workspace_danger(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` must not be a box's writable workspace (None: it may be). The box may
    create, change and delete anything there."""
    real = os.path.realpath(path)
    if real == "/":
        return "it is the host's root directory"
    for tree in _SYSTEM_TREES:
        if real == tree or real.startswith(tree + "/"):
            return f"it is a system directory ({tree})"
    if real in _SYSTEM_DIRS and real not in ("/root", "/home"):
        return f"it is a system directory ({real})"
    for home in _homes():
        if real == home:
            return "it is a home directory (keys, tokens and shell startup files live there)"
        rel = real[len(home) + 1 :] if real.startswith(home + "/") else ""
        top = rel.split("/")[0]
        if top.startswith(".") and ("/" not in rel or top in _KEY_STORES):
            return f"it is a home directory's {top} (keys, tokens and settings live there)"
        if home.startswith(real + "/"):
            return f"it holds a home directory ({home})"
    return None


LIBRARY_FIX = (
    "Give a project directory, or no workspace for a fresh temporary one; to share it anyway, "
    "pass allow_dangerous_workspace=True"
)


def refuse_dangerous_workspace(
    path: str | os.PathLike[str], *, fix: str = LIBRARY_FIX, shown_as: str = ""
) -> None:
    """Raise :class:`~corral.errors.DangerousWorkspace` naming the cause and ``fix`` when
    ``path`` must not be a workspace (blocking: it reads the password database)."""
    why = workspace_danger(path)
    if why is None:
        return
    real = os.path.realpath(path)
    raise DangerousWorkspace(
        f"refusing {real}{shown_as} as the workspace: {why}, and the box could change "
        f"anything in it. {fix}",
        workspace=real,
        reason=why,
    )
