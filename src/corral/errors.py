"""The one error tree of corral, with stable codes.

Every error corral raises derives from :class:`SandboxError` and carries a ``code`` from
:class:`ErrorCode` (stable, safe to show to an agent and to match on) and a human sentence
that names the cause and, where there is one, the fix.

::

    SandboxError                     code
    ├── PolicyError (ValueError)     invalid_policy
    ├── BackendError                 backend_failed
    │   └── BackendUnavailable       backend_unavailable
    │       └── ProcessStateUnavailable  process_state_unavailable (snapshot: processes)
    ├── SandboxClosed                sandbox_closed
    ├── SandboxPaused                sandbox_paused
    ├── SandboxBroken                sandbox_broken
    ├── ProtocolError                protocol_error
    ├── RequestTooLarge (ValueError) request_too_large
    ├── ProcessError
    │   ├── ProcessNotFound          process_not_found
    │   ├── SpawnFailed              spawn_failed
    │   │   ├── CommandNotFound      command_not_found  (run(): a result with exit 127)
    │   │   └── NotExecutable        not_executable     (run(): a result with exit 126)
    │   └── CommandFailed            command_failed   (check=True and exit != 0)
    ├── SessionError
    │   ├── SessionNotFound          session_not_found
    │   └── SessionBusy              session_busy
    ├── FileOpError
    │   ├── PathOutsideSandbox       path_outside_sandbox
    │   ├── FileNotFound             file_not_found
    │   ├── FileTooLarge             file_too_large
    │   ├── FilePermissionDenied     permission_denied
    │   ├── IsADirectory             is_a_directory
    │   ├── NotADirectory            not_a_directory
    │   └── NotARegularFile          not_a_regular_file (a FIFO, socket or device node)
    ├── ImageError                   image_error
    │   ├── ImageNotFound            image_not_found
    │   ├── DigestMismatch           digest_mismatch
    │   ├── CorruptLayer             corrupt_layer
    │   ├── UnsafeLayer              unsafe_layer
    │   └── ImageTooLarge            image_too_large
    ├── Timeout (TimeoutError)       timeout
    └── ServerError                  server_error     (corral serve and its clients)
        ├── BoxNotFound (LookupError) box_not_found
        ├── Unauthorized             unauthorized     (no or a wrong token, wrong scope)
        ├── ServerBusy               server_busy      (start cap or start budget hit)
        ├── ServerUnavailable        server_unavailable (not reachable, or restarting)
        └── PortNotReachable         port_not_reachable (nothing answers on a box's port)

:data:`RETRYABLE` names the codes that say the infrastructure failed, not the command: a
harness retries those instead of scoring the attempt.

A non-zero exit status is a result, not an error (see ``CommandResult``), unless the caller
asked for ``check=True``.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(enum.StrEnum):
    """Stable codes; agents and tools match on these, never on class names."""

    INVALID_POLICY = "invalid_policy"
    INVALID_INPUT = "invalid_input"
    BACKEND_FAILED = "backend_failed"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    PROCESS_STATE_UNAVAILABLE = "process_state_unavailable"
    SANDBOX_CLOSED = "sandbox_closed"
    SANDBOX_BROKEN = "sandbox_broken"
    SANDBOX_PAUSED = "sandbox_paused"
    PROTOCOL_ERROR = "protocol_error"
    REQUEST_TOO_LARGE = "request_too_large"
    PROCESS_NOT_FOUND = "process_not_found"
    SPAWN_FAILED = "spawn_failed"
    COMMAND_NOT_FOUND = "command_not_found"
    NOT_EXECUTABLE = "not_executable"
    COMMAND_FAILED = "command_failed"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_BUSY = "session_busy"
    PATH_OUTSIDE_SANDBOX = "path_outside_sandbox"
    FILE_NOT_FOUND = "file_not_found"
    FILE_TOO_LARGE = "file_too_large"
    PERMISSION_DENIED = "permission_denied"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    FILE_ERROR = "file_error"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    TIMEOUT = "timeout"
    IMAGE_ERROR = "image_error"
    IMAGE_NOT_FOUND = "image_not_found"
    DIGEST_MISMATCH = "digest_mismatch"
    CORRUPT_LAYER = "corrupt_layer"
    UNSAFE_LAYER = "unsafe_layer"
    IMAGE_TOO_LARGE = "image_too_large"
    # Agent-tool layer (corral.tools): results handed to a model, never raised to it.
    ACCESS_DENIED = "access_denied"
    APPROVAL_REQUIRED = "approval_required"
    APPROVAL_DENIED = "approval_denied"
    UNKNOWN_TOOL = "unknown_tool"
    RUNTIME_NOT_FOUND = "runtime_not_found"
    INTERNAL_ERROR = "internal_error"
    NO_SESSION = "no_session"
    # corral serve and its clients (corral.server, corral.client).
    SERVER_ERROR = "server_error"
    BOX_NOT_FOUND = "box_not_found"
    UNAUTHORIZED = "unauthorized"
    SERVER_BUSY = "server_busy"
    SERVER_UNAVAILABLE = "server_unavailable"
    PORT_NOT_REACHABLE = "port_not_reachable"


class SandboxError(Exception):
    """Root of every error corral raises."""

    code: ErrorCode = ErrorCode.BACKEND_FAILED

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The structured form handed to agents: a stable code and a sentence."""
        return {"error": {"code": str(self.code), "message": self.message}}

    @property
    def retryable(self) -> bool:
        """The infrastructure failed, not the command or its input (:data:`RETRYABLE`): a
        harness retries the attempt rather than scoring it."""
        return self.code in RETRYABLE


class PolicyError(SandboxError, ValueError):
    code = ErrorCode.INVALID_POLICY


class DangerousWorkspace(SandboxError, ValueError):
    """A workspace the box must not be given: ``/``, a system directory, a home directory
    (or a directory holding one). The box could create, change and delete anything there.
    ``workspace`` is the directory (resolved), ``reason`` why it is refused."""

    code = ErrorCode.INVALID_INPUT

    def __init__(self, message: str, *, workspace: str, reason: str) -> None:
        super().__init__(message)
        self.workspace = workspace
        self.reason = reason


class BackendError(SandboxError):
    code = ErrorCode.BACKEND_FAILED


class BackendUnavailable(BackendError):
    code = ErrorCode.BACKEND_UNAVAILABLE


class ProcessStateUnavailable(BackendUnavailable):
    """A snapshot asked to keep a box's running processes (``processes="error"``) where
    their state cannot be saved; the message says why (CRIU unusable on this kernel, or a
    backend without process checkpointing)."""

    code = ErrorCode.PROCESS_STATE_UNAVAILABLE


class SandboxClosed(SandboxError):
    code = ErrorCode.SANDBOX_CLOSED


class SandboxPaused(SandboxError):
    """A request to a paused box (``Sandbox.pause``): ``resume()`` first."""

    code = ErrorCode.SANDBOX_PAUSED


class SandboxBroken(SandboxError):
    code = ErrorCode.SANDBOX_BROKEN


class ProtocolError(SandboxError):
    code = ErrorCode.PROTOCOL_ERROR


class RequestTooLarge(SandboxError, ValueError):
    """A request larger than one message to the box can carry (a command line and
    environment beyond 16 MiB once encoded); the kernel's own limits come back as results."""

    code = ErrorCode.REQUEST_TOO_LARGE


class ProcessError(SandboxError):
    code = ErrorCode.PROCESS_NOT_FOUND


class ProcessNotFound(ProcessError, LookupError):
    code = ErrorCode.PROCESS_NOT_FOUND


class SpawnFailed(ProcessError):
    code = ErrorCode.SPAWN_FAILED


class CommandNotFound(SpawnFailed):
    """The program does not exist. ``run`` returns a result with exit 127 instead."""

    code = ErrorCode.COMMAND_NOT_FOUND


class NotExecutable(SpawnFailed):
    """The program exists but cannot be executed. ``run`` returns a result with exit 126."""

    code = ErrorCode.NOT_EXECUTABLE


class CommandFailed(ProcessError):
    """Raised by ``run(..., check=True)``; ``result`` carries the full CommandResult."""

    code = ErrorCode.COMMAND_FAILED

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


class SessionError(SandboxError):
    code = ErrorCode.SESSION_NOT_FOUND


class SessionNotFound(SessionError, LookupError):
    code = ErrorCode.SESSION_NOT_FOUND


class SessionBusy(SessionError):
    code = ErrorCode.SESSION_BUSY


class FileOpError(SandboxError):
    code = ErrorCode.FILE_ERROR


class PathOutsideSandbox(FileOpError, PermissionError):
    code = ErrorCode.PATH_OUTSIDE_SANDBOX


class FileNotFound(FileOpError, FileNotFoundError):
    code = ErrorCode.FILE_NOT_FOUND


class FileTooLarge(FileOpError):
    code = ErrorCode.FILE_TOO_LARGE


class FilePermissionDenied(FileOpError, PermissionError):
    code = ErrorCode.PERMISSION_DENIED


class IsADirectory(FileOpError, IsADirectoryError):
    code = ErrorCode.IS_A_DIRECTORY


class NotADirectory(FileOpError, NotADirectoryError):
    code = ErrorCode.NOT_A_DIRECTORY


class NotARegularFile(FileOpError):
    """A read or write of a FIFO, socket or device node (refused without blocking)."""

    code = ErrorCode.NOT_A_REGULAR_FILE


class ImageError(SandboxError):
    """An image could not be pulled, imported or unpacked (the cache is left as it was)."""

    code = ErrorCode.IMAGE_ERROR


class ImageNotFound(ImageError, LookupError):
    """No such image: not in the registry, the layout, the archive or the local store."""

    code = ErrorCode.IMAGE_NOT_FOUND


class DigestMismatch(ImageError):
    """A blob's content does not hash to the digest its manifest or config names."""

    code = ErrorCode.DIGEST_MISMATCH


class CorruptLayer(ImageError):
    """A layer is truncated or is not a (compressed) tar stream."""

    code = ErrorCode.CORRUPT_LAYER


class UnsafeLayer(ImageError):
    """A layer tries to leave its root (``../``, a path through a symlink) or holds a device
    node."""

    code = ErrorCode.UNSAFE_LAYER


class ImageTooLarge(ImageError):
    """A layer unpacks to more bytes or files than the store allows (a tarball bomb)."""

    code = ErrorCode.IMAGE_TOO_LARGE


class Timeout(SandboxError, TimeoutError):
    code = ErrorCode.TIMEOUT


class ServerError(SandboxError):
    """``corral serve`` or the way to it failed (see the subclasses)."""

    code = ErrorCode.SERVER_ERROR


class BoxNotFound(ServerError, LookupError):
    """No box of that id on the server (never made, deleted, or reaped at its TTL)."""

    code = ErrorCode.BOX_NOT_FOUND


class Unauthorized(ServerError, PermissionError):
    """The server refused the caller: no token, a wrong one, or one without the scope."""

    code = ErrorCode.UNAUTHORIZED


class ServerBusy(ServerError):
    """Too many boxes starting at once, or a start over its time budget: retry later."""

    code = ErrorCode.SERVER_BUSY


class ServerUnavailable(ServerError, ConnectionError):
    """The server cannot be reached, or is shutting down."""

    code = ErrorCode.SERVER_UNAVAILABLE


class PortNotReachable(ServerError, ConnectionError):
    """A preview URL's box port did not answer (nothing listens on it, or it closed the
    connection without a response): HTTP 502."""

    code = ErrorCode.PORT_NOT_REACHABLE


RETRYABLE = frozenset(
    {
        ErrorCode.BACKEND_FAILED,
        ErrorCode.SANDBOX_BROKEN,
        ErrorCode.PROTOCOL_ERROR,
        ErrorCode.SERVER_BUSY,
        ErrorCode.SERVER_UNAVAILABLE,
        ErrorCode.INTERNAL_ERROR,
    }
)
"""Codes that mean the infrastructure failed (the box died, a start timed out, the server is
restarting), not the command or its input: the same request may succeed when retried."""


def _leaves(cls: type[SandboxError]) -> list[type[SandboxError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_leaves(sub))
    return found


_NEEDS_MORE = (DangerousWorkspace, CommandFailed)  # constructors that take more than a message


def from_code(code: str, message: str) -> SandboxError:
    """The error class of ``code`` (the most specific one), for errors that crossed a wire:
    a remote client raises what the library would have raised in-process."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return SandboxError(message, code=ErrorCode.INTERNAL_ERROR)
    for cls in _leaves(SandboxError):  # the class that brought the code in, ours only
        if cls.__module__ == __name__ and cls.code is known and cls not in _NEEDS_MORE:
            return cls(message)
    return SandboxError(message, code=known)
