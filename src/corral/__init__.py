"""corral: run AI agents' commands and code inside Linux sandboxes, safely and fast.

::

    import corral

    async with corral.Sandbox() as sb:
        result = await sb.run("echo hello")

Importing :mod:`corral` is cheap: each public name is imported from its module on first use
(PEP 562), so a program (or the ``corral`` command) that needs only part of the library pays
only for that part.
"""

from __future__ import annotations

from corral._lazy import lazy_dir, lazy_getattr

TYPE_CHECKING = False  # importing typing would cost every `corral` command

if TYPE_CHECKING:
    from corral.client.remote import Remote
    from corral.errors import (
        BackendError,
        BackendUnavailable,
        BoxNotFound,
        CommandFailed,
        CommandNotFound,
        DangerousWorkspace,
        ErrorCode,
        FileNotFound,
        FileOpError,
        FilePermissionDenied,
        FileTooLarge,
        IsADirectory,
        NotADirectory,
        NotARegularFile,
        NotExecutable,
        PathOutsideSandbox,
        PolicyError,
        ProcessError,
        ProcessNotFound,
        ProcessStateUnavailable,
        ProtocolError,
        RequestTooLarge,
        SandboxBroken,
        SandboxClosed,
        SandboxError,
        SandboxPaused,
        ServerBusy,
        ServerError,
        ServerUnavailable,
        SessionBusy,
        SessionError,
        SessionNotFound,
        SpawnFailed,
        Timeout,
        Unauthorized,
    )
    from corral.models import (
        CommandResult,
        FileInfo,
        ProcessInfo,
        ProcessStats,
        Snapshot,
        WaitResult,
    )
    from corral.policy import (
        FilesystemPolicy,
        Limits,
        Mount,
        NetworkPolicy,
        Policy,
        ProcessTracking,
        PublishedPort,
        SecurityPolicy,
    )
    from corral.pool import SandboxPool
    from corral.processes import Process
    from corral.sandbox import Sandbox
    from corral.sessions.terminal import AttachOutcome
    from corral.sync import SyncSandbox

_LAZY: dict[str, str] = {
    "AttachOutcome": "corral.sessions.terminal",
    "BackendError": "corral.errors",
    "BackendUnavailable": "corral.errors",
    "BoxNotFound": "corral.errors",
    "ProcessStateUnavailable": "corral.errors",
    "Snapshot": "corral.models",
    "CommandFailed": "corral.errors",
    "CommandNotFound": "corral.errors",
    "CommandResult": "corral.models",
    "DangerousWorkspace": "corral.errors",
    "ErrorCode": "corral.errors",
    "FileInfo": "corral.models",
    "FileNotFound": "corral.errors",
    "FileOpError": "corral.errors",
    "FilePermissionDenied": "corral.errors",
    "FileTooLarge": "corral.errors",
    "FilesystemPolicy": "corral.policy",
    "IsADirectory": "corral.errors",
    "Limits": "corral.policy",
    "Mount": "corral.policy",
    "NetworkPolicy": "corral.policy",
    "NotADirectory": "corral.errors",
    "NotARegularFile": "corral.errors",
    "NotExecutable": "corral.errors",
    "PathOutsideSandbox": "corral.errors",
    "Policy": "corral.policy",
    "PolicyError": "corral.errors",
    "Process": "corral.processes",
    "ProcessError": "corral.errors",
    "ProcessInfo": "corral.models",
    "ProcessNotFound": "corral.errors",
    "ProcessStats": "corral.models",
    "ProcessTracking": "corral.policy",
    "ProtocolError": "corral.errors",
    "PublishedPort": "corral.policy",
    "RequestTooLarge": "corral.errors",
    "Sandbox": "corral.sandbox",
    "SandboxBroken": "corral.errors",
    "SandboxClosed": "corral.errors",
    "SandboxError": "corral.errors",
    "SandboxPaused": "corral.errors",
    "SandboxPool": "corral.pool",
    "SecurityPolicy": "corral.policy",
    "ServerBusy": "corral.errors",
    "ServerError": "corral.errors",
    "ServerUnavailable": "corral.errors",
    "SessionBusy": "corral.errors",
    "SessionError": "corral.errors",
    "SessionNotFound": "corral.errors",
    "SpawnFailed": "corral.errors",
    "SyncSandbox": "corral.sync",
    "Timeout": "corral.errors",
    "Unauthorized": "corral.errors",
    "WaitResult": "corral.models",
}
"""Public name -> the module defining it."""

__all__ = [
    "AttachOutcome",
    "BackendError",
    "BackendUnavailable",
    "BoxNotFound",
    "CommandFailed",
    "CommandNotFound",
    "CommandResult",
    "DangerousWorkspace",
    "ErrorCode",
    "FileInfo",
    "FileNotFound",
    "FileOpError",
    "FilePermissionDenied",
    "FileTooLarge",
    "FilesystemPolicy",
    "IsADirectory",
    "Limits",
    "Mount",
    "NetworkPolicy",
    "NotADirectory",
    "NotARegularFile",
    "NotExecutable",
    "PathOutsideSandbox",
    "Policy",
    "PolicyError",
    "Process",
    "ProcessError",
    "ProcessInfo",
    "ProcessNotFound",
    "ProcessStateUnavailable",
    "ProcessStats",
    "ProcessTracking",
    "ProtocolError",
    "PublishedPort",
    "RequestTooLarge",
    "Sandbox",
    "SandboxBroken",
    "SandboxClosed",
    "SandboxError",
    "SandboxPaused",
    "SandboxPool",
    "SecurityPolicy",
    "ServerBusy",
    "ServerError",
    "ServerUnavailable",
    "SessionBusy",
    "SessionError",
    "SessionNotFound",
    "Snapshot",
    "SpawnFailed",
    "SyncSandbox",
    "Timeout",
    "Unauthorized",
    "WaitResult",
    "connect",
]


def connect(url: str | None = None, token: str | None = None, *, timeout: float = 300.0) -> Remote:
    """A client of a running ``corral serve`` whose ``Sandbox``/``SandboxPool`` have this
    library's API (see :mod:`corral.client.remote`): ``http://HOST:PORT`` or
    ``unix:/path/serve.sock``; default ``$CORRAL_HOST``, else the user's default socket."""
    from corral.client.remote import connect as remote_connect

    return remote_connect(url, token, timeout=timeout)


__getattr__ = lazy_getattr(globals(), _LAZY)
__dir__ = lazy_dir(globals())
