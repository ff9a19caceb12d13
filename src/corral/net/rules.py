"""What the egress proxy lets through: host allowlist matching and address screening (sans-IO).

Two independent checks, both pure so they are unit-tested without sockets:

- :class:`HostAllowlist` matches the *name the program asked for* (``host`` and port) against
  ``network.allow_hosts``. ``example.com`` matches only itself; ``*.example.com`` matches every
  subdomain at any depth but not ``example.com`` itself (list both for both) and never
  ``badexample.com``; ``*`` matches every host. An entry without a port allows every port.
- :class:`AddressScreen` checks every address the name *resolved to*: private, loopback,
  link-local, CGNAT, multicast, reserved and cloud-metadata addresses are refused unless
  covered by ``network.allow_private``. IPv4-mapped (``::ffff:10.0.0.1``), IPv4-compatible,
  6to4 and NAT64 forms are unwrapped first, so an IPv6 spelling cannot smuggle a private
  IPv4 address through.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from corral.errors import PolicyError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")

METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack
        ipaddress.ip_address("fd00:ec2::254"),  # AWS IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
        ipaddress.ip_address("169.254.170.2"),  # AWS ECS task metadata
    }
)

CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")

# Everything a box in ``full`` mode must not reach unless allowed (fed to nftables too).
BLOCKED_V4: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
BLOCKED_V6: tuple[str, ...] = (
    "::/127",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "100::/64",
    "2001:db8::/32",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
)


def normalize_host(host: str) -> str:
    """Lower-case, IDNA-encoded, without a trailing dot; IP literals in canonical form.

    Raises ValueError for anything that is neither a DNS name nor an IP literal.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    h = h.rstrip(".").lower()
    if not h or len(h) > 253:
        raise ValueError(f"not a host name: {host!r}")
    if not h.isascii():
        try:
            h = h.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"not a valid international host name: {host!r}") from None
    if not all(_LABEL.match(label) for label in h.split(".")):
        raise ValueError(f"not a host name: {host!r}")
    return h


def split_host_port(authority: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``host`` (with ``default_port``) -> (host, port)."""
    a = authority.strip()
    if a.startswith("["):
        end = a.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in {authority!r}")
        host, rest = a[1:end], a[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"junk after ']' in {authority!r}")
        port_text = rest[1:] if rest else ""
    elif a.count(":") == 1:
        host, port_text = a.split(":")
    else:
        host, port_text = a, ""  # a bare name, or a bare IPv6 literal
    if not port_text:
        if default_port is None:
            raise ValueError(f"no port in {authority!r}")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad port {port_text!r} in {authority!r}")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class HostRule:
    pattern: str
    """A normalized host, ``*.suffix`` or ``*``."""
    port: int | None
    """None: every port."""

    @classmethod
    def parse(cls, entry: str) -> HostRule:
        """Parse one ``network.allow_hosts`` entry (PolicyError naming the entry if bad)."""
        try:
            host, port = split_host_port(entry, 0)
            if host == "*":
                return cls("*", port or None)
            if host.startswith("*."):
                return cls("*." + normalize_host(host[2:]), port or None)
            if "*" in host:
                raise ValueError("'*' is only allowed as a whole first label ('*.example.com')")
            return cls(normalize_host(host), port or None)
        except ValueError as exc:
            raise PolicyError(
                f"network.allow_hosts entry {entry!r} is not valid: {exc}; "
                "use 'host', 'host:port', '*.example.com' or '*'"
            ) from None

    def matches(self, host: str, port: int) -> bool:
        """``host`` must already be normalized."""
        if self.port is not None and self.port != port:
            return False
        if self.pattern == "*":
            return True
        if self.pattern.startswith("*."):
            return host.endswith(self.pattern[1:])
        return host == self.pattern


class HostAllowlist:
    def __init__(self, entries: Iterable[str]) -> None:
        self.rules = tuple(HostRule.parse(e) for e in entries)

    def allows(self, host: str, port: int) -> bool:
        """Whether the normalized ``host`` at ``port`` is on the list."""
        return any(rule.matches(host, port) for rule in self.rules)


def unwrap(ip: IPAddress) -> IPAddress:
    """The IPv4 address hidden in an IPv6 one (mapped, compatible, 6to4, NAT64), else ``ip``."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    packed = int(ip)
    if packed >> 32 == 0 and packed > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(packed)
    return ip


def classify(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public unicast address ("loopback", "private", ...), or None."""
    ip = unwrap(ip)
    if ip in METADATA_ADDRESSES:
        return "cloud metadata"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if isinstance(ip, ipaddress.IPv4Address) and ip in CGNAT:
        return "shared (CGNAT)"
    if ip.is_private:
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


def parse_networks(entries: Iterable[str], field: str = "network.allow_private") -> list[IPNetwork]:
    nets: list[IPNetwork] = []
    for entry in entries:
        try:
            nets.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise PolicyError(
                f"{field} entry {entry!r} is not an address or CIDR (e.g. '10.0.0.5', "
                "'192.168.0.0/16', '::1')"
            ) from None
    return nets


class AddressScreen:
    """Refuses non-public addresses unless ``allow_private`` covers them."""

    def __init__(self, allow_private: Iterable[str]) -> None:
        self.allowed = parse_networks(allow_private)

    def is_allowed_private(self, ip: IPAddress) -> bool:
        candidates = {ip, unwrap(ip)}
        return any(
            c.version == net.version and c in net for c in candidates for net in self.allowed
        )

    def refusal(self, ip: IPAddress) -> str | None:
        """Why a connection to ``ip`` is refused, or None when it may go ahead."""
        kind = classify(ip)
        if kind is None or self.is_allowed_private(ip):
            return None
        return kind
