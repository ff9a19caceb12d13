"""Results are data: frozen dataclasses the library returns and the tools serialise."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

ProcessStatus = Literal["running", "exited"]
Ending = Literal["exited", "signalled", "timed_out", "oom_killed", "lost", "not_started"]
"""How a command ended: it ``exited`` by itself (any status), a signal killed it
(``signalled``), its timeout ended it (``timed_out``: SIGTERM, then SIGKILL after
``limits.kill_grace_secs``), the box's memory limit killed it (``oom_killed``), the box died
under it (``lost``), or it never started (``not_started``: exit 127, the program was not
found, or 126, it is not executable; ``stderr`` says which, as a shell would)."""


@dataclass(frozen=True, slots=True)
class NetworkRefusal:
    """A connection the box's network policy refused (or could not make) while a command ran:
    the host and port the program asked for, how (``connect``, ``http``, ``socks5``), the
    HTTP status the proxy answered with (403: the policy; 502/504: resolving or connecting
    failed) and one line saying why and how to allow it."""

    host: str
    port: int
    protocol: str
    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The outcome of ``Sandbox.run``. A non-zero exit is a result, not an error."""

    exit_code: int
    """Exit status; ``-N`` when killed by signal N (as ``subprocess`` reports it)."""
    stdout: str
    stderr: str
    timed_out: bool
    duration: float
    """Seconds from start to exit."""
    truncated: bool
    """True when output beyond ``limits.output_bytes`` was dropped (head and tail are kept)."""
    pid: int
    oom_killed: bool = False
    """True when the box's memory limit killed a process while this command ran."""
    pids_limited: bool = False
    """True when the box's process limit refused a fork while this command ran."""
    network_refusals: tuple[NetworkRefusal, ...] = ()
    """Connections the network policy refused while this command ran (programs often show
    only "403"; this says which host and how to allow it)."""
    timeout: float | None = None
    """The timeout in effect, in seconds (the call's, else ``limits.exec_timeout_secs``);
    None when the command could run for ever."""
    ended: Ending = "exited"
    """How the command ended (see :data:`Ending`)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["duration_ms"] = round(self.duration * 1000, 3)
        del data["duration"]
        return data


@dataclass(frozen=True, slots=True)
class WaitResult:
    """The outcome of ``Process.wait``: ``exited`` with a code, or ``timeout``."""

    pid: int
    status: Literal["exited", "timeout"]
    exit_code: int | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process started in a box: what :meth:`Sandbox.processes` lists."""

    pid: int
    command: str
    status: ProcessStatus
    exit_code: int | None
    started_at: float
    """Unix time the process started."""
    duration: float
    """Seconds it has run (so far, or in all)."""
    timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """What a process of a box has used so far (:meth:`Process.stats`)."""

    pid: int
    status: str
    cpu_seconds: float
    """CPU time used so far; after the exit, the total (its reaped descendants included)."""
    rss_bytes: int
    """Resident memory now; after the exit, the peak it reached."""
    processes: int
    """How many processes its process group holds now (0 after the exit)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class FileInfo:
    """An entry of the box's filesystem, as ``files.list`` and ``files.stat`` give it."""

    name: str
    path: str
    """Absolute path inside the box."""
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SnapshotProcesses = Literal["warn", "error"]
"""What a snapshot does when processes other than the guest agent run in the box and their
state cannot be kept: ``warn`` (a filesystem-only snapshot, saying so in
:attr:`Snapshot.warnings`) or ``error`` (``ProcessStateUnavailable``, naming why)."""


class Snapshot(str):
    """What ``Sandbox.snapshot`` returns: the new image's ref (a ``str``: what
    ``Policy(image=...)``, ``Sandbox.restore`` and ``corral run --image`` take) and what it
    kept. ``warnings``: what it could not keep (running processes, when the caller chose
    ``processes="warn"``); ``workspace``: whether it carries the box's workspace too;
    ``processes``: how many processes besides the guest agent ran (their state is never
    kept: filesystem only)."""

    warnings: tuple[str, ...]
    workspace: bool
    processes: int

    def __new__(
        cls,
        ref: str,
        *,
        warnings: tuple[str, ...] = (),
        workspace: bool = False,
        processes: int = 0,
    ) -> Snapshot:
        self = super().__new__(cls, ref)
        self.warnings, self.workspace, self.processes = warnings, workspace, processes
        return self

    @property
    def ref(self) -> str:
        return str(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": str(self),
            "warnings": list(self.warnings),
            "workspace": self.workspace,
            "processes": self.processes,
        }
