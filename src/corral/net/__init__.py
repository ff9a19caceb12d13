"""Network policy for every backend: egress proxy, port relays, user-mode NAT.

=========  ==================================================================================
mode       what the box can reach, and how
=========  ==================================================================================
none       nothing: an empty network namespace with loopback only
allowlist  ``allow_hosts`` through corral's HTTP/SOCKS5 proxy on the host, reached through a
           unix socket and a loopback forwarder of the guest agent (127.0.0.1:3128 inside)
ports      the listed host loopback ports, at the same numbers, through the same relays
full       anything public through pasta's user-mode NAT; private, loopback, link-local and
           metadata ranges rejected by nftables in the box's namespace unless allowed
=========  ==================================================================================

In every mode, ``publish`` makes box ports reachable from the host (:mod:`corral.net.publish`).

Backends use :class:`BoxNetwork` (binds, agent forwarders, ``attach(pid)``, ``close()``) and
:func:`command_env`; nothing here depends on a backend.
"""

from corral.net.box import BoxNetwork, sweep
from corral.net.env import GUEST_NET_DIR, command_env, proxy_port
from corral.net.proxy import EgressProxy
from corral.net.publish import PortInUse
from corral.net.resolver import ResolveError, Resolver, StaticResolver, SystemResolver
from corral.net.rules import AddressScreen, HostAllowlist

__all__ = [
    "GUEST_NET_DIR",
    "AddressScreen",
    "BoxNetwork",
    "EgressProxy",
    "HostAllowlist",
    "PortInUse",
    "ResolveError",
    "Resolver",
    "StaticResolver",
    "SystemResolver",
    "command_env",
    "proxy_port",
    "sweep",
]
