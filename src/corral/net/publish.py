"""Published ports (``docker run -p``): a host TCP listener reaching a port inside the box.

The box may have no route anywhere (network mode ``none``), so the host cannot connect into
it; the guest agent dials out instead, over the unix socket that the other relays use too
(:mod:`corral.net.ports`), so every backend that binds the network directory works alike::

    host client --TCP--> host_ip:host_port (this module)
                              | asks over the agent's control connection: b"\\x01"
    guest agent  --unix--> publish-PORT.sock, sends b"D"  (one data connection per request)
    guest agent  --TCP---> 127.0.0.1:box_port inside the box, then relays both ways

The agent's first connection sends ``b"C"`` and stays open as the control connection; each
byte the host writes on it asks for one data connection. Every data connection reaches the
same box port, so the host pairs them with waiting clients in any order. A box port nobody
listens on yields a data connection the agent closes at once, and the client's connection
is closed too (as with docker). The host never connects to anything the box names.

A microVM cannot bind the socket: its agent dials a loopback forwarder of the link
(:mod:`corral.net.vmlink`) that reaches the same socket, at :func:`corral.net.box.link_port`.
"""

from __future__ import annotations

import asyncio
import errno
from collections import deque
from pathlib import Path

from corral.audit import AuditLog
from corral.errors import ErrorCode, SandboxError
from corral.net.proxy import RELAY_CHUNK, UnixService, relay
from corral.policy import PublishedPort

HELLO_TIMEOUT = 10.0
"""How long a new unix connection has to say what it is."""
ANSWER_TIMEOUT = 30.0
"""How long a host client waits for the agent's data connection."""
MAX_WAITING = 256
"""Host clients waiting for the agent at once; more are closed at once (each one asks the
agent for a connection and a thread, so a flood of them must not pile up in the box)."""
CONTROL, DATA, REQUEST = b"C", b"D", b"\x01"

_Client = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class PortInUse(SandboxError):
    """The host port of a published port is taken (or cannot be bound)."""

    code = ErrorCode.INVALID_INPUT


class PortPublisher(UnixService):
    """Host side of one published port; see the module docstring."""

    def __init__(self, spec: PublishedPort, audit: AuditLog | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.audit = audit
        self.host_port = spec.port_on_host
        """The port listened on (the one picked, once :meth:`listen` ran, for port 0)."""
        self._listener: asyncio.Server | None = None
        self._control: asyncio.StreamWriter | None = None
        self._waiting: deque[_Client] = deque()
        self._asked = 0  # requests the control connection has been sent

    @property
    def published(self) -> PublishedPort:
        return self.spec.model_copy(update={"host_port": self.host_port})

    async def listen(self) -> None:
        """Bind the host port; a clear :class:`PortInUse` when that fails."""
        host, port = self.spec.host_ip, self.spec.port_on_host
        try:
            self._listener = await asyncio.start_server(
                self._on_client, host, port, limit=RELAY_CHUNK
            )
        except OSError as exc:
            raise PortInUse(_bind_problem(self.spec, exc)) from None
        self.host_port = self._listener.sockets[0].getsockname()[1]

    async def serve(self, path: Path) -> None:
        self._server = await asyncio.start_unix_server(self._on_agent, path=str(path))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        while self._waiting:
            self._waiting.popleft()[1].close()
        await super().close()

    # ---- host clients ----------------------------------------------------------------------
    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) >= MAX_WAITING:
            writer.close()
            self._record("error", reason=f"{MAX_WAITING} connections already wait for the box")
            return
        client = (reader, writer)
        self._waiting.append(client)
        self._ask()
        loop = asyncio.get_running_loop()
        loop.call_later(ANSWER_TIMEOUT, self._give_up, client)

    def _ask(self) -> None:
        control = self._control
        if control is None or control.is_closing():
            return
        missing = len(self._waiting) - self._asked
        if missing > 0:
            control.write(REQUEST * missing)
            self._asked += missing

    def _give_up(self, client: _Client) -> None:
        if client in self._waiting:
            self._waiting.remove(client)
            self._asked = max(0, self._asked - 1)
            client[1].close()
            self._record("error", reason="the box did not answer in time")

    # ---- the guest agent's connections ---------------------------------------------------
    async def _on_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                hello = await reader.read(1)
            if hello == CONTROL and self._control is None:
                await self._hold_control(reader, writer)
            elif hello == DATA and self._waiting:
                self._asked = max(0, self._asked - 1)
                client_r, client_w = self._waiting.popleft()
                self._record("allow")
                try:
                    await relay(client_r, client_w, reader, writer)
                finally:
                    client_w.close()
        except (OSError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _hold_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._control = writer
        self._asked = 0
        try:
            self._ask()
            while await reader.read(4096):
                pass  # the agent sends nothing more; EOF: it went away
        finally:
            self._control = None

    def _record(self, action: str, **extra: object) -> None:
        if self.audit is not None:
            self.audit.record(
                "network",
                action=action,
                protocol="publish",
                host=self.spec.host_ip,
                port=self.host_port,
                box_port=self.spec.box_port,
                **extra,
            )


def _bind_problem(spec: PublishedPort, exc: OSError) -> str:
    where = f"{spec.host_ip}:{spec.port_on_host}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot publish box port {spec.box_port} on {where}: the host port is in use; "
            f"pick another (e.g. -p {spec.port_on_host + 1}:{spec.box_port}) or 0 for any free one"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot publish on {where}: {spec.host_ip} is not an address of this host"
    if exc.errno == errno.EACCES:
        return f"cannot publish on {where}: permission denied (a privileged port?)"
    return f"cannot publish box port {spec.box_port} on {where}: {exc.strerror or exc}"


async def listen_all(publishers: list[PortPublisher]) -> None:
    """Bind every host port, or none (a failure closes those already bound)."""
    try:
        for publisher in publishers:
            await publisher.listen()
    except BaseException:
        for publisher in publishers:
            await publisher.close()
        raise
