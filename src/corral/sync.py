"""A thin synchronous facade for scripts and sync frameworks.

The async :class:`corral.Sandbox` runs on a private event loop in a background thread; each
sync call submits one coroutine to it and blocks for the result. Nothing is reimplemented
here, so the two APIs cannot drift apart.

::

    with corral.SyncSandbox() as sb:
        print(sb.run("echo hi").stdout)
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from corral.models import CommandResult, FileInfo, ProcessInfo, ProcessStats, WaitResult
from corral.net import Resolver
from corral.policy import Policy, PublishedPort, RlimitName
from corral.processes import Process
from corral.sandbox import Command, Sandbox, StdinArg
from corral.sessions.terminal import DEFAULT_DETACH_KEYS, AttachOutcome, forward_window_changes

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="corral-sync", daemon=True
        )
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run in the loop's thread, its result here. Interrupted here (Ctrl-C's
        KeyboardInterrupt), the call is cancelled there and waited for before the interrupt
        goes on, as an async caller's cancellation would: the command ends (TERM, the
        grace, KILL), a start is undone. Left running, a command finished after the caller
        saw the interrupt, and a start left its box behind. A second interrupt while the
        cancellation finishes goes through at once."""
        done = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def begin() -> None:
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: done.set())
            tasks.append(task)

        def cancel() -> None:  # after begin: call_soon_threadsafe keeps the order
            tasks[0].cancel()

        self.loop.call_soon_threadsafe(begin)
        try:
            done.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(cancel)
            done.wait()
            raise
        return tasks[0].result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class SyncProcess:
    def __init__(self, proc: Process, loop: _Loop) -> None:
        self._proc = proc
        self._loop = loop
        self.pid = proc.pid

    def __repr__(self) -> str:
        return repr(self._proc)

    @property
    def status(self) -> str:
        return self._proc.status

    @property
    def exit_code(self) -> int | None:
        return self._proc.exit_code

    def wait(self, timeout: float | None = None) -> WaitResult:
        return self._loop.call(self._proc.wait(timeout))

    def output(self, stream: Literal["stdout", "stderr"] = "stdout") -> str:
        return self._proc.output(stream)

    def signal(self, sig: str | int = "SIGTERM") -> bool:
        return self._loop.call(self._proc.signal(sig))

    def kill(self) -> bool:
        return self._loop.call(self._proc.kill())

    def terminate(self, grace: float | None = None) -> WaitResult:
        """SIGTERM to the group, SIGKILL after the grace, then the reap (``Process.terminate``)."""
        return self._loop.call(self._proc.terminate(grace))

    def write(self, data: bytes | str, *, eof: bool = False) -> None:
        self._loop.call(self._proc.write(data, eof=eof))

    def stats(self) -> ProcessStats:
        return self._loop.call(self._proc.stats())


class SyncFiles:
    def __init__(self, sandbox: Sandbox, loop: _Loop) -> None:
        self._files = sandbox.files
        self._loop = loop

    def read(
        self, path: str, *, max_bytes: int | None = None, offset: int = 0, length: int | None = None
    ) -> bytes:
        return self._loop.call(
            self._files.read(path, max_bytes=max_bytes, offset=offset, length=length)
        )

    def read_text(self, path: str) -> str:
        return self._loop.call(self._files.read_text(path))

    def write(self, path: str, data: bytes | str, *, append: bool = False) -> int:
        return self._loop.call(self._files.write(path, data, append=append))

    def list(self, path: str = ".") -> list[FileInfo]:
        return self._loop.call(self._files.list(path))

    def exists(self, path: str) -> bool:
        return self._loop.call(self._files.exists(path))

    def mkdir(self, path: str) -> None:
        self._loop.call(self._files.mkdir(path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._loop.call(self._files.remove(path, recursive=recursive))


class SyncSandbox:
    """``Sandbox`` for synchronous code: same arguments, same results."""

    def __init__(
        self,
        policy: Policy | str | os.PathLike[str] | None = None,
        *,
        workspace: str | os.PathLike[str] | None = None,
        resolver: Resolver | None = None,
        allow_dangerous_workspace: bool = False,
        ready_timeout: float | None = None,
        exposable: bool = False,
    ) -> None:
        self._loop = _Loop()
        self._sandbox = Sandbox(
            policy,
            workspace=workspace,
            resolver=resolver,
            allow_dangerous_workspace=allow_dangerous_workspace,
            ready_timeout=ready_timeout,
            exposable=exposable,
        )
        self.files = SyncFiles(self._sandbox, self._loop)
        try:
            self._loop.call(self._sandbox.start())
        except BaseException:
            self._loop.call(self._sandbox.aclose())
            self._loop.stop()
            raise

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def workspace(self) -> Path | None:
        return self._sandbox.workspace

    @property
    def published(self) -> tuple[PublishedPort, ...]:
        """``Sandbox.published``: the box ports reachable from the host."""
        return self._sandbox.published

    def expose(self, port: int, *, host_port: int = 0, host_ip: str = "127.0.0.1") -> PublishedPort:
        """``Sandbox.expose``: publish box ``port`` on the host now."""
        return self._loop.call(self._sandbox.expose(port, host_port=host_port, host_ip=host_ip))

    def unexpose(self, port: int) -> bool:
        """``Sandbox.unexpose``: stop publishing box ``port``."""
        return self._loop.call(self._sandbox.unexpose(port))

    def run(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        rlimits: dict[RlimitName, int] | None = None,
        check: bool = False,
    ) -> CommandResult:
        """``Sandbox.run``, blocking."""
        run = self._sandbox.run(
            cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, rlimits=rlimits, check=check
        )
        return self._loop.call(run)

    def spawn(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: StdinArg = None,
        rlimits: dict[RlimitName, int] | None = None,
        pty: bool = False,
        cols: int = 80,
        rows: int = 24,
    ) -> SyncProcess:
        """``Sandbox.spawn``: the process runs on in the background."""
        spawn = self._sandbox.spawn(
            cmd, cwd=cwd, env=env, stdin=stdin, rlimits=rlimits, pty=pty, cols=cols, rows=rows
        )
        return SyncProcess(self._loop.call(spawn), self._loop)

    def attach(
        self,
        command: Command,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """``Sandbox.attach``: this terminal bridged to ``command`` in the box, blocking."""
        attach = self._sandbox.attach(
            command, env=env, cwd=cwd, detach_keys=detach_keys, stdin=stdin, stdout=stdout
        )
        with forward_window_changes():
            return self._loop.call(attach)

    def attach_shell(
        self,
        shell: str | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """``Sandbox.attach_shell``, blocking."""
        attach = self._sandbox.attach_shell(
            shell, env=env, cwd=cwd, detach_keys=detach_keys, stdin=stdin, stdout=stdout
        )
        with forward_window_changes():
            return self._loop.call(attach)

    def reattach(
        self,
        session_id: str,
        *,
        detach_keys: str = DEFAULT_DETACH_KEYS,
        stdin: int = 0,
        stdout: int = 1,
    ) -> AttachOutcome:
        """``Sandbox.reattach``, blocking."""
        attach = self._sandbox.reattach(
            session_id, detach_keys=detach_keys, stdin=stdin, stdout=stdout
        )
        with forward_window_changes():
            return self._loop.call(attach)

    def processes(self) -> list[ProcessInfo]:
        return self._sandbox.processes()

    def info(self) -> dict[str, Any]:
        return self._loop.call(self._sandbox.info())

    def close(self) -> None:
        if self._loop.thread.is_alive():
            self._loop.call(self._sandbox.aclose())
            self._loop.stop()
