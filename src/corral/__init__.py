"""corral: run AI agents' commands and code inside Linux sandboxes, safely and fast.

::

    import corral

    async with corral.Sandbox() as sb:
        result = await sb.run("echo hello")
"""

from corral.errors import (
    BackendError,
    BackendUnavailable,
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
    ProtocolError,
    RequestTooLarge,
    SandboxBroken,
    SandboxClosed,
    SandboxError,
    SessionBusy,
    SessionError,
    SessionNotFound,
    SpawnFailed,
    Timeout,
)
from corral.models import CommandResult, FileInfo, ProcessInfo, ProcessStats, WaitResult
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

__all__ = [
    "AttachOutcome",
    "BackendError",
    "BackendUnavailable",
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
    "ProcessStats",
    "ProcessTracking",
    "ProtocolError",
    "PublishedPort",
    "RequestTooLarge",
    "Sandbox",
    "SandboxBroken",
    "SandboxClosed",
    "SandboxError",
    "SandboxPool",
    "SecurityPolicy",
    "SessionBusy",
    "SessionError",
    "SessionNotFound",
    "SpawnFailed",
    "SyncSandbox",
    "Timeout",
    "WaitResult",
]
