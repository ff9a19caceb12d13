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

from __future__ import annotations

from typing import TYPE_CHECKING

from corral._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from corral.net.box import BoxNetwork, sweep
    from corral.net.env import GUEST_NET_DIR, command_env, proxy_port
    from corral.net.proxy import EgressProxy
    from corral.net.publish import PortInUse
    from corral.net.resolver import ResolveError, Resolver, StaticResolver, SystemResolver
    from corral.net.rules import AddressScreen, HostAllowlist

_LAZY: dict[str, str] = {
    "AddressScreen": "corral.net.rules",
    "BoxNetwork": "corral.net.box",
    "EgressProxy": "corral.net.proxy",
    "GUEST_NET_DIR": "corral.net.env",
    "HostAllowlist": "corral.net.rules",
    "PortInUse": "corral.net.publish",
    "ResolveError": "corral.net.resolver",
    "Resolver": "corral.net.resolver",
    "StaticResolver": "corral.net.resolver",
    "SystemResolver": "corral.net.resolver",
    "command_env": "corral.net.env",
    "proxy_port": "corral.net.env",
    "sweep": "corral.net.box",
}
"""Public name -> the module defining it, imported on first use."""

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

__getattr__ = lazy_getattr(globals(), _LAZY)
__dir__ = lazy_dir(globals())
