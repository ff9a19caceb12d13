"""Name resolution for the egress proxy: the system's (async getaddrinfo) or a fixed table.

The proxy resolves names itself, on the host, so the addresses it screens are the addresses
it connects to (no second lookup for DNS rebinding to race). :class:`StaticResolver` maps
names to fixed addresses, like an ``/etc/hosts`` of the proxy: tests point names such as
``allowed.test`` at servers on 127.0.0.1 with it (they still need ``allow_private``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from typing import Protocol

from corral.net.rules import IPAddress, normalize_host


class ResolveError(Exception):
    """A name that did not resolve (the message says why)."""


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """Addresses of the normalized ``host`` (ResolveError when there are none)."""
        ...


class SystemResolver:
    """The host's resolver, through the event loop's thread pool."""

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ResolveError(f"cannot resolve {host}: {exc.strerror}") from None
        seen: dict[IPAddress, None] = {}
        for _family, _type, _proto, _name, sockaddr in infos:
            seen[ipaddress.ip_address(str(sockaddr[0]).split("%")[0])] = None
        if not seen:
            raise ResolveError(f"cannot resolve {host}: no addresses")
        return list(seen)


class StaticResolver:
    """Fixed ``name -> address(es)``; other names go to ``fallback`` or fail to resolve."""

    def __init__(
        self,
        names: Mapping[str, str | Sequence[str]],
        fallback: Resolver | None = None,
    ) -> None:
        self.table: dict[str, list[IPAddress]] = {}
        for name, value in names.items():
            values = [value] if isinstance(value, str) else list(value)
            self.table[normalize_host(name)] = [ipaddress.ip_address(v) for v in values]
        self.fallback = fallback

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        found = self.table.get(host)
        if found:
            return list(found)
        if self.fallback is not None:
            return await self.fallback.resolve(host, port)
        raise ResolveError(f"cannot resolve {host}: not in the proxy's static host table")
