"""Network relays of a box with no route out: loopback listeners inside the box relaying every
connection to a host unix socket (:mod:`corral.net`: the egress proxy, exposed host ports),
and published box ports, for which the agent dials the host (:mod:`corral.net.publish`).

In a microVM the same listeners carry their connections over a port device (:mod:`vmlink`).
Threads keep the agent's select loop untouched.
"""

from __future__ import annotations

import socket

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any


def start(config: dict[str, Any]) -> None:
    """Start the relays the agent's config names (``forwarders``, ``publishers``,
    ``vmlink``)."""
    start_forwarders(list(config.get("forwarders") or []))
    if config.get("vmlink"):  # a microVM: the forwarders go over a virtio-serial port
        start_vmlink(dict(config["vmlink"]))
    start_publishers(list(config.get("publishers") or []))  # after: they may use the link


def start_forwarders(specs: list[dict[str, Any]]) -> None:
    """Loopback listeners relaying every connection to a host unix socket (corral.net).

    This is how a box with no route out reaches the host's egress proxy and exposed ports.
    Threads keep the agent's select loop untouched; the sockets are mode 0666 on the host,
    so relaying works whichever ids the agent holds at the moment.
    """
    if not specs:
        return
    import threading

    if TYPE_CHECKING:
        from corral.agent.vmlink import loopback_listeners
    else:
        from vmlink import loopback_listeners

    for spec in specs:
        for server in loopback_listeners(int(spec["port"])):
            args = (server, str(spec["unix"]))
            threading.Thread(target=forward_accept, args=args, daemon=True).start()


def start_vmlink(config: dict[str, Any]) -> None:
    """Loopback listeners multiplexed over a port device to the host (:mod:`vmlink`)."""
    if TYPE_CHECKING:
        from corral.agent import vmlink
    else:
        import vmlink
    vmlink.start(config)


def start_publishers(specs: list[dict[str, Any]]) -> None:
    """Published box ports: hold a control connection to each host socket and open one data
    connection per byte the host sends on it (the protocol of :mod:`corral.net.publish`)."""
    import threading

    for spec in specs:
        # the host socket, or (a microVM) the loopback forwarder of the link that reaches it
        host = str(spec["unix"]) if spec.get("unix") else ("127.0.0.1", int(spec["link"]))
        args = (int(spec["port"]), host)
        threading.Thread(target=publish_control, args=args, daemon=True).start()


def dial_host(host: Any) -> socket.socket:
    family = socket.AF_UNIX if isinstance(host, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.connect(host)
    except OSError:
        sock.close()
        raise
    return sock


def publish_control(port: int, host: Any) -> None:
    import threading

    try:
        control = dial_host(host)
    except OSError:
        return
    try:
        control.sendall(b"C")
        while True:
            asked = control.recv(4096)
            if not asked:
                return
            for _ in asked:
                threading.Thread(target=publish_conn, args=(port, host), daemon=True).start()
    except OSError:
        return
    finally:
        control.close()


def publish_conn(port: int, host: Any) -> None:
    """One data connection: to the host, then to the box port on loopback (IPv4, else
    IPv6); a box port nobody listens on closes the data connection at once."""
    try:
        data = dial_host(host)
    except OSError:
        return
    try:
        data.sendall(b"D")
    except OSError:
        data.close()
        return
    server = None
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        candidate = socket.socket(family, socket.SOCK_STREAM)
        try:
            candidate.connect((address, port))
        except OSError:
            candidate.close()
            continue
        server = candidate
        break
    if server is None:
        data.close()
        return
    relay_pair(server, data)


def relay_pair(a: socket.socket, b: socket.socket) -> None:
    import threading

    back = threading.Thread(target=forward_copy, args=(b, a), daemon=True)
    back.start()
    forward_copy(a, b)
    back.join()
    a.close()
    b.close()


def forward_accept(server: socket.socket, path: str) -> None:
    import threading

    while True:
        try:
            conn, _ = server.accept()
        except (ConnectionAbortedError, InterruptedError):
            continue
        except OSError:
            return
        threading.Thread(target=forward_conn, args=(conn, path), daemon=True).start()


def forward_conn(conn: socket.socket, path: str) -> None:

    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        conn.close()
        upstream.close()
        return
    relay_pair(conn, upstream)


def forward_copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(262144)
            if not data:
                break
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
