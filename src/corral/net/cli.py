"""``corral run`` network options: ``--network``, ``--allow-host``, ``--allow-port``,
``--allow-private`` and ``-p/--publish``, applied over the policy file's ``[network]`` table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from corral.errors import PolicyError

if TYPE_CHECKING:
    from corral.models import NetworkRefusal
    from corral.policy import Policy, PublishedPort
    from corral.sandbox import Sandbox

MODES = ("none", "allowlist", "ports", "full")


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (1-65535)")
    return int(text)


def _publish(text: str) -> PublishedPort:
    from corral.policy import PublishedPort

    try:
        return PublishedPort.parse(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(exc.message.removeprefix("invalid policy: ")) from None


def add_publish_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-p",
        "--publish",
        action="append",
        default=[],
        type=_publish,
        metavar="[IP:]HOST:BOX",
        help="reach the box's port BOX at IP:HOST on the host (IP default 127.0.0.1; HOST 0: "
        "any free port; BOX alone: the same port); works with every --network mode",
    )


def add_network_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--network",
        choices=MODES,
        help="none (default): no network; allowlist: only --allow-host hosts, through corral's "
        "proxy; ports: only --allow-port host ports; full: NAT, private ranges blocked",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="allow HOST, HOST:PORT or *.DOMAIN through the proxy (repeatable; implies "
        "--network allowlist)",
    )
    p.add_argument(
        "--allow-port",
        action="append",
        default=[],
        type=_port,
        metavar="PORT",
        help="expose the host's 127.0.0.1:PORT inside the box at the same port (repeatable; "
        "implies --network ports when no other mode is chosen)",
    )
    p.add_argument(
        "--allow-private",
        action="append",
        default=[],
        metavar="ADDR",
        help="reach this private/loopback address or CIDR anyway (repeatable)",
    )


def apply_network_options(policy: Policy, args: argparse.Namespace) -> Policy:
    """The policy with the command line's network options on top of its own."""
    mode: str | None = getattr(args, "network", None)
    hosts: list[str] = list(getattr(args, "allow_host", None) or [])
    ports: list[int] = list(getattr(args, "allow_port", None) or [])
    private: list[str] = list(getattr(args, "allow_private", None) or [])
    publish: list[PublishedPort] = list(getattr(args, "publish", None) or [])
    if mode is None and not (hosts or ports or private or publish):
        return policy
    from corral.policy import NetworkPolicy, Policy

    current = policy.network
    if mode == "none" and (hosts or ports):
        raise PolicyError("--network none contradicts --allow-host/--allow-port; drop one of them")
    if mode is None:
        if hosts:
            mode = "allowlist"
        elif current.mode != "none":
            mode = current.mode
        elif ports:
            mode = "ports"
        else:
            mode = current.mode
    if hosts and mode != "allowlist":
        raise PolicyError(f"--allow-host needs --network allowlist, not {mode}")
    data = current.model_dump()
    data.update(
        mode=mode,
        allow_hosts=[*current.allow_hosts, *hosts],
        ports=sorted({*current.ports, *ports}),
        allow_private=[*current.allow_private, *private],
        publish=[p.model_dump() for p in (*current.publish, *publish)],
    )
    try:
        network = NetworkPolicy.model_validate(data)
    except ValueError as exc:
        raise PolicyError(f"invalid network options: {exc}") from None
    return Policy.from_dict({**policy.model_dump(), "network": network.model_dump()})


def say_published(sb: Sandbox) -> None:
    """On stderr, where each ``-p 0:BOX`` (any free host port) landed."""
    for line in published_lines(sb):
        print(line, file=sys.stderr, flush=True)


def published_lines(sb: Sandbox) -> list[str]:
    """The lines of :func:`say_published` (``corral run`` through a server sends them as
    notes)."""
    asked = {(p.host_ip, p.box_port) for p in sb.policy.network.publish if p.port_on_host == 0}
    return [f"corral: published {p}" for p in sb.published if (p.host_ip, p.box_port) in asked]


def refusal_lines(refusals: Sequence[NetworkRefusal], limit: int = 10) -> list[str]:
    """What ``corral run`` prints on stderr after a command whose connections were refused:
    one line per distinct refusal (its reason names the fix), then how many more."""
    reasons = list(dict.fromkeys(r.reason.removeprefix("corral: ") for r in refusals))
    lines = [f"corral: network refused: {reason}" for reason in reasons[:limit]]
    if len(reasons) > limit:
        lines.append(f"corral: ... and {len(reasons) - limit} more network refusals")
    return lines
