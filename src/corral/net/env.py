"""Where the network pieces appear inside a box, and the environment that points tools at them.

Pure functions of the policy, shared by every backend: each backend binds the host directory
of :class:`corral.net.BoxNetwork` at :data:`GUEST_NET_DIR` and starts the guest agent with
:meth:`BoxNetwork.forwarders`, so the addresses below hold in every box.
"""

from __future__ import annotations

from corral.policy import NetworkPolicy

GUEST_NET_DIR = "/run/corral-net"
"""Where the host's network directory appears inside the box (read-only bind): the proxy and
port sockets, and the node preload. Not under /run/corral, which commands cannot enter."""
NODE_PRELOAD = "node_proxy.js"
"""A script (copied into the network directory) that routes node's ``fetch`` via the proxy."""
PROXY_PORT = 3128
"""Loopback port of the proxy inside the box (the next free one if a policy port takes it)."""
NO_PROXY = "localhost,127.0.0.1,::1"


def proxy_port(policy: NetworkPolicy) -> int:
    port = PROXY_PORT
    while port in policy.ports:
        port += 1
    return port


def proxy_url(policy: NetworkPolicy) -> str:
    return f"http://127.0.0.1:{proxy_port(policy)}"


def command_env(policy: NetworkPolicy) -> dict[str, str]:
    """Variables that send HTTP(S) and other TCP clients through the proxy (allowlist mode).

    curl, wget, python (urllib, requests, httpx, pip), git, npm, yarn and Go honour these;
    node's built-in ``fetch`` ignores them, hence the ``--require`` preload.
    """
    if policy.mode != "allowlist":
        return {}
    url = proxy_url(policy)
    socks = f"socks5h://127.0.0.1:{proxy_port(policy)}"
    env: dict[str, str] = {}
    for name, value in (
        ("HTTP_PROXY", url),
        ("HTTPS_PROXY", url),
        ("ALL_PROXY", socks),
        ("NO_PROXY", NO_PROXY),
    ):
        env[name] = value
        env[name.lower()] = value
    env.update(
        {
            "npm_config_proxy": url,
            "npm_config_https_proxy": url,
            "YARN_HTTP_PROXY": url,
            "YARN_HTTPS_PROXY": url,
            "PIP_PROXY": url,
            # pip retries a refused CONNECT 5 times with backoff (12-15 s of silence): the
            # proxy's refusals are final, whatever the status (urllib3 retries every tunnel
            # failure), so one quick retry is left for real upstream hiccups.
            "PIP_RETRIES": "1",
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "http.proxy",
            "GIT_CONFIG_VALUE_0": url,
            "NODE_OPTIONS": f"--require {GUEST_NET_DIR}/{NODE_PRELOAD}",
            "CORRAL_PROXY": url,
        }
    )
    return env
