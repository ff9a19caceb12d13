"""One box's network: what a backend asks for, whatever the isolation technology.

A backend wires a :class:`BoxNetwork` in four places and knows nothing else about it::

    for host, guest in net.binds():          # read-only binds into the box
        ...
    agent_config["forwarders"] = net.forwarders()   # loopback listeners of the guest agent
    if net.needs_attach:                      # full mode, before the agent is released
        await net.attach(child_pid)
    # ...and the sandbox calls net.ready() once the agent answered (pasta comes up then)
    # commands get corral.net.command_env(policy.network) through box_env()

The sandbox creates it (``start()`` before the backend, ``close()`` after it), so the proxy
lives in the sandbox's event loop and writes to the sandbox's audit log.

Who can reach the sockets. On the host::

    net/        0700, owned by the box's root (host uid HOST_UID_BASE): pasta's files, the
                namespace handles, resolv.conf
    net/box/    0755 root, bound read-only at /run/corral-net: the sockets, the node preload
    *.sock      0660, owner the box's root, group the box user's host gid (COMMAND_HOST_ID)

Another local uid stops at ``net/`` (it cannot search it) and could not write to a socket
anyway. The box reaches ``net/box`` through its bind mount, which does not pass through
``net/``; bwrap makes that bind as the box's root, hence the owner of ``net/``. The guest
agent connects as the box's root, or as the box user while a file operation of the agent
holds the user's ids (glibc changes the ids of every thread of a process): hence the group.
The microVM's link connects from this process on the host.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.audit import AuditLog
from corral.backends.host import mounts
from corral.backends.users import COMMAND_HOST_ID, HOST_UID_BASE
from corral.errors import BackendError, PolicyError
from corral.models import NetworkRefusal
from corral.net.env import GUEST_NET_DIR, NODE_PRELOAD, proxy_port
from corral.policy import NetworkPolicy, PublishedPort

# The proxy, relays, publishers and NAT are imported by the box that has a network (a box of
# network mode none, the default, starts without them).
if TYPE_CHECKING:
    from corral.net.proxy import EgressProxy
    from corral.net.resolver import Resolver

PROXY_SOCKET = "proxy.sock"
GUEST_SUBDIR = "box"
"""The part of the network directory bound into the box."""
UNIX_PATH_MAX = 107
PASTA_RUNAS = HOST_UID_BASE
"""Host uid pasta runs as: the owner of the box's user namespace (box root)."""
SOCKET_MODE = 0o660


def port_socket(port: int) -> str:
    return f"port-{port}.sock"


def publish_socket(index: int, box_port: int) -> str:
    return f"publish-{index}-{box_port}.sock"


LINK_PORT_BASE = 64900
"""Guest loopback ports (from here up) of published ports' forwarders in a microVM: above the
kernel's default ephemeral range (32768-60999), so no outgoing connection of the box takes
one first."""


def link_port(index: int) -> int:
    return LINK_PORT_BASE + index


_NETWORK_MODULES = (
    "corral.net.nat",
    "corral.net.ports",
    "corral.net.proxy",
    "corral.net.publish",
    "corral.net.resolver",
    "corral.net.rules",
)


def network_loaded() -> bool:
    """Whether the modules a networked box needs are imported (see :func:`load_network`)."""
    return all(name in sys.modules for name in _NETWORK_MODULES)


def load_network() -> None:
    """Import what a box with a network needs: done in a thread by the first such box of a
    process, so the imports do not hold its event loop."""
    for name in _NETWORK_MODULES:
        importlib.import_module(name)


class BoxNetwork:
    """The host side of a box's network policy: proxy, port relays, NAT."""

    def __init__(
        self,
        policy: NetworkPolicy,
        host_dir: Path,
        *,
        audit: AuditLog | None = None,
        resolver: Resolver | None = None,
        nat_uid: int = PASTA_RUNAS,
        box_root: int = HOST_UID_BASE,
        box_user_gid: int = COMMAND_HOST_ID,
        exposable: bool = False,
    ) -> None:
        if policy.mode == "none" and not policy.publish and not exposable:
            raise PolicyError(
                "BoxNetwork is for network modes other than 'none', or ports to publish "
                "(now or later: exposable)"
            )
        self.policy = policy
        self.host_dir = host_dir
        self.guest_dir = host_dir / GUEST_SUBDIR
        """What the box sees at :data:`GUEST_NET_DIR`."""
        self.box_root = box_root
        self.box_user_gid = box_user_gid
        self.audit = audit
        from corral.net.nat import Nat
        from corral.net.ports import PortRelay
        from corral.net.proxy import EgressProxy
        from corral.net.publish import PortPublisher
        from corral.net.resolver import SystemResolver
        from corral.net.rules import AddressScreen, HostAllowlist

        self.screen = AddressScreen(policy.allow_private)
        self.allowlist = HostAllowlist(policy.allow_hosts)
        self.proxy: EgressProxy | None = None
        if policy.mode == "allowlist":
            self.proxy = EgressProxy(
                self.allowlist, self.screen, resolver or SystemResolver(), audit
            )
        self.relays = [PortRelay(port, audit) for port in policy.ports]
        self.publishers = [PortPublisher(spec, audit) for spec in policy.publish]
        # id(publisher) -> the index in its socket's name (publish() adds, unpublish() ends)
        self._indexes = {id(p): i for i, p in enumerate(self.publishers)}
        self.nat = Nat(self.screen, host_dir, nat_uid) if policy.mode == "full" else None
        self._started = False

    @classmethod
    def for_policy(
        cls,
        policy: NetworkPolicy,
        host_dir: Path,
        *,
        audit: AuditLog | None = None,
        resolver: Resolver | None = None,
        exposable: bool = False,
    ) -> BoxNetwork | None:
        """None for ``none`` (nothing to run) unless ``exposable`` (an empty network
        directory, bound so that :meth:`publish` works later); PolicyError for contradictory
        settings."""
        if policy.mode == "none":
            if policy.ports or policy.allow_hosts:
                field = "ports" if policy.ports else "allow_hosts"
                raise PolicyError(
                    f"network.{field} is set but network.mode is 'none', which reaches nothing; "
                    f"set network.mode to {'ports' if policy.ports else 'allowlist'!r}"
                )
            if not policy.publish and not exposable:
                return None
        if policy.mode == "allowlist" and not policy.allow_hosts:
            raise PolicyError(
                "network.mode 'allowlist' with an empty network.allow_hosts reaches nothing; "
                "add hosts (e.g. 'pypi.org', '*.github.com') or use network.mode 'none'"
            )
        if policy.mode == "ports" and not policy.ports:
            raise PolicyError(
                "network.mode 'ports' with an empty network.ports exposes nothing; "
                "list host loopback ports (e.g. [8080]) or use network.mode 'none'"
            )
        return cls(policy, host_dir, audit=audit, resolver=resolver, exposable=exposable)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        from corral.net.publish import listen_all

        await listen_all(self.publishers)  # first: a host port in use fails the start at once
        self.host_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._started = True
        if os.geteuid() == 0:  # rootless: the directory is the user's, in its state root
            os.chown(self.host_dir, self.box_root, self.box_root)
        self.host_dir.chmod(0o700)
        self.guest_dir.mkdir(mode=0o755, exist_ok=True)
        self.guest_dir.chmod(0o755)
        if self.proxy is not None:
            path = self._socket_path(PROXY_SOCKET)
            await self.proxy.serve(path)
            self._grant(path)
            preload = self.guest_dir / NODE_PRELOAD
            shutil.copyfile(Path(__file__).with_name(NODE_PRELOAD), preload)
            preload.chmod(0o644)
        for relay in self.relays:
            path = self._socket_path(port_socket(relay.port))
            await relay.serve(path)
            self._grant(path)
        for index, publisher in enumerate(self.publishers):
            path = self._socket_path(publish_socket(index, publisher.spec.box_port))
            await publisher.serve(path)
            self._grant(path)
        if self.nat is not None:
            from corral.net.nat import DNS_ADDRESS

            resolv = self.host_dir / "resolv.conf"
            resolv.write_text(f"nameserver {DNS_ADDRESS}\n")
            resolv.chmod(0o644)

    def _grant(self, socket_path: Path) -> None:
        """Let the box's root and its user (see the module docstring) connect, no one else.

        Rootless (corral is not root): the sockets stay the user's, open to any id, since
        box root is a subordinate id of the user's; they lie in the user's 0700 state
        directory, which no other host user can enter."""
        if os.geteuid() != 0:
            socket_path.chmod(0o666)
            return
        os.chown(socket_path, self.box_root, self.box_user_gid)
        socket_path.chmod(SOCKET_MODE)

    def admit(self, uid: int, gid: int, *, namespace_owner: int | None = None) -> None:
        """Who connects to the sockets, when a backend knows better than the default (box
        root ``HOST_UID_BASE``, box user group ``COMMAND_HOST_ID``): the box user's group
        where commands act as the workspace owner. ``namespace_owner``: the host uid that
        owns the user namespace of the box's network namespace, which pasta runs as to
        attach to it (bwrap: each box's own, see :mod:`corral.backends.host.ucounts`)."""
        self.box_root, self.box_user_gid = uid, gid
        if namespace_owner is not None and self.nat is not None:
            self.nat.runas = namespace_owner
        if self._started and os.geteuid() == 0:
            os.chown(self.host_dir, uid, uid)
            for path in self.guest_dir.iterdir():
                if path.is_socket():
                    self._grant(path)

    @property
    def refusal_count(self) -> int:
        """Connections refused so far: a mark for :meth:`refusals_since`."""
        return self.proxy.refusal_count if self.proxy is not None else 0

    def refusals_since(self, mark: int) -> tuple[NetworkRefusal, ...]:
        """What the egress proxy refused after :attr:`refusal_count` was ``mark``."""
        return self.proxy.refusals_since(mark) if self.proxy is not None else ()

    def _socket_path(self, name: str) -> Path:
        path = self.guest_dir / name
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise BackendError(
                f"socket path {path} is longer than the {UNIX_PATH_MAX} bytes unix sockets "
                "allow; set CORRAL_STATE_DIR to a shorter directory"
            )
        return path

    async def close(self) -> None:
        """Stop the proxy and relays, end pasta, remove the sockets. Idempotent."""
        if self.nat is not None:
            await self.nat.close()
        if self.proxy is not None:
            await self.proxy.close()
        for relay in self.relays:
            await relay.close()
        for publisher in self.publishers:
            await publisher.close()
        if self._started:
            shutil.rmtree(self.host_dir, ignore_errors=True)
            self._started = False

    # ---- what a backend asks for ---------------------------------------------------------
    def binds(self) -> list[tuple[str, str]]:
        """(host path, guest path) pairs to bind read-only into the box."""
        binds = [(str(self.guest_dir), GUEST_NET_DIR)]
        if self.nat is not None:
            binds.append((str(self.host_dir / "resolv.conf"), "/etc/resolv.conf"))
        return binds

    def forwarders(self) -> list[dict[str, Any]]:
        """Loopback listeners the guest agent runs: ``{"port": N, "unix": guest socket}``."""
        out: list[dict[str, Any]] = []
        if self.proxy is not None:
            out.append({"port": proxy_port(self.policy), "unix": f"{GUEST_NET_DIR}/{PROXY_SOCKET}"})
        out += [
            {"port": relay.port, "unix": f"{GUEST_NET_DIR}/{port_socket(relay.port)}"}
            for relay in self.relays
        ]
        return out

    def publishers_config(self) -> list[dict[str, Any]]:
        """Published ports, for the guest agent: ``{"port": box port, "unix": guest socket}``
        (the agent dials the host for each connection, see :mod:`corral.net.publish`)."""
        return [
            {
                "port": p.spec.box_port,
                "unix": f"{GUEST_NET_DIR}/{publish_socket(i, p.spec.box_port)}",
            }
            for i, p in enumerate(self.publishers)
        ]

    @property
    def published(self) -> tuple[PublishedPort, ...]:
        """The published ports, with the host port chosen for each ``0``."""
        return tuple(p.published for p in self.publishers)

    async def publish(self, spec: PublishedPort) -> dict[str, Any]:
        """Publish one more box port on a started box (``Sandbox.expose``): bind the host
        port, serve its socket in the network directory the box already sees, and return
        the agent's :meth:`publishers_config` entry for it (the caller sends it on)."""
        from corral.net.publish import PortPublisher

        publisher = PortPublisher(spec, self.audit)
        await publisher.listen()
        index = self._next_index()
        path = self._socket_path(publish_socket(index, spec.box_port))
        try:
            await publisher.serve(path)
            self._grant(path)
        except BaseException:
            await publisher.close()
            path.unlink(missing_ok=True)
            raise
        self.publishers.append(publisher)
        self._indexes[id(publisher)] = index
        return {"port": spec.box_port, "unix": f"{GUEST_NET_DIR}/{path.name}"}

    async def unpublish(self, box_port: int) -> list[PublishedPort]:
        """Stop publishing ``box_port`` (every host port it has): the host ports close and
        the agent's control connection ends with the socket. Returns what was closed."""
        closed = [p for p in self.publishers if p.spec.box_port == box_port]
        for publisher in closed:
            self.publishers.remove(publisher)
            index = self._indexes.pop(id(publisher), None)
            await publisher.close()
            if index is not None:
                (self.guest_dir / publish_socket(index, box_port)).unlink(missing_ok=True)
        return [p.published for p in closed]

    def _next_index(self) -> int:
        """A socket index no publisher used yet (the start's, then :meth:`publish`'s)."""
        return max(self._indexes.values(), default=-1) + 1

    def unix_forwarders(self) -> list[tuple[int, Path]]:
        """``(guest port, host unix socket)`` per forwarder, in :meth:`forwarders` order, then
        one per published port at :func:`link_port` (which the agent dials instead of the
        socket, :meth:`linked_publishers`): for a backend that cannot bind sockets into its
        box (the microVM relays them itself)."""
        out = [(f["port"], self.guest_dir / Path(f["unix"]).name) for f in self.forwarders()]
        out += [
            (link_port(i), self.guest_dir / publish_socket(i, p.spec.box_port))
            for i, p in enumerate(self.publishers)
        ]
        return out

    def linked_publishers(self) -> list[dict[str, Any]]:
        """:meth:`publishers_config` for a box whose agent reaches the host sockets through
        loopback forwarders (``{"port": box port, "link": guest loopback port}``)."""
        return [
            {"port": p.spec.box_port, "link": link_port(i)} for i, p in enumerate(self.publishers)
        ]

    def guest_files(self) -> dict[str, str]:
        """What a box that cannot bind the network directory must be given: the node preload
        that ``NODE_OPTIONS`` names, by guest path (allowlist mode), as text."""
        if self.proxy is None:
            return {}
        preload = Path(__file__).with_name(NODE_PRELOAD).read_text()
        return {f"{GUEST_NET_DIR}/{NODE_PRELOAD}": preload}

    @property
    def needs_attach(self) -> bool:
        """Whether :meth:`attach` must run before the box's agent starts (``full``)."""
        return self.nat is not None

    async def attach(self, pid: int) -> None:
        """Fence the network namespace of ``pid`` (a process of the box) before its agent
        runs: the nftables rules hold from the first instruction of the box."""
        if self.nat is not None:
            await self.nat.fence(pid)

    async def make_netns(self, id_maps: tuple[str, str] | None = None) -> str | None:
        """For runtimes that join a network namespace by path (OCI): a fenced one made by
        corral (``full`` mode), or None when the box gets a new, empty one. ``id_maps``:
        see :meth:`corral.net.nat.Nat.make_netns` (then :attr:`userns_path` is the box's)."""
        return await self.nat.make_netns(id_maps) if self.nat is not None else None

    @property
    def userns_path(self) -> str | None:
        """The user namespace :meth:`make_netns` made (None if it made none)."""
        return str(self.nat.userns_file) if self.nat is not None and self.nat.held else None

    async def ready(self) -> None:
        """The agent is up: connect the fenced namespace to the outside (pasta)."""
        if self.nat is not None:
            await self.nat.connect()


def sweep(host_dir: Path) -> None:
    """End what a box whose owner died left running (its pasta), for the orphan sweeps."""
    from corral.net.nat import kill_pasta

    with contextlib.suppress(OSError):
        kill_pasta(host_dir / "pasta.pid")
    for held in ("netns", "userns"):  # namespaces a full-mode OCI box joined by path
        mounts.umount_all(str(host_dir / held))
