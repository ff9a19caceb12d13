"""Which network modes work on this host, and why not (for ``corral doctor``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from corral.net.nat import missing_tools

_UNSHARE_NET = ("unshare", "--net")
_NFT_PROBE = ("nft", "add", "table", "inet", "corral_probe")


@dataclass(frozen=True, slots=True)
class ModeSupport:
    mode: str
    ok: bool
    detail: str
    fix: str = ""


def _nftables_works() -> str | None:
    """None when nftables rules can be loaded into a fresh network namespace, else why not."""
    try:
        proc = subprocess.run(
            # Rootless, the box's own user namespace gives nft its CAP_NET_ADMIN: probe alike.
            [*_UNSHARE_NET, *([] if os.geteuid() == 0 else ["--map-root-user"]), *_NFT_PROBE],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def mode_support() -> list[ModeSupport]:
    node = shutil.which("node")
    modes = [
        ModeSupport("none", True, "empty network namespace, loopback only"),
        ModeSupport(
            "allowlist",
            True,
            "corral's HTTP/SOCKS5 proxy through a unix socket"
            + ("; node fetch() routed by a preload" if node else ""),
        ),
        ModeSupport("ports", True, "host loopback ports relayed through unix sockets"),
    ]
    missing = missing_tools()
    if missing:
        modes.append(
            ModeSupport(
                "full",
                False,
                "needs " + ", ".join(missing),
                "apt-get install passt nftables (slirp4netns alone is not used: corral "
                "fences full mode with nftables and attaches pasta)",
            )
        )
        return modes
    why = _nftables_works()
    if why is not None:
        modes.append(
            ModeSupport(
                "full",
                False,
                f"nftables cannot load rules in a network namespace: {why}",
                "load the nf_tables kernel module (modprobe nf_tables)",
            )
        )
    else:
        detail = "pasta NAT, private ranges fenced by nftables in the box"
        if os.geteuid() != 0:
            detail += (
                "; rootless: pasta runs as you, the fence is loaded through the box's user "
                "namespace (yours) before the agent starts (backend bwrap; oci refuses full)"
            )
        modes.append(ModeSupport("full", True, detail))
    return modes
