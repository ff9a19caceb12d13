"""``full`` mode: user-mode NAT with pasta, fenced by nftables rules in the box's netns.

The box starts in an empty network namespace (loopback only). Before its agent is released
the host, as root:

1. loads an nftables table into the box's namespace whose output chain rejects every
   private, loopback, link-local, CGNAT, multicast, reserved and metadata destination not
   covered by ``network.allow_private``. Nothing in the box can change it: the agent holds
   only CAP_SETUID/CAP_SETGID and commands hold no capability at all;
2. attaches pasta to the namespace (tap interface, address, default route copied from the
   host). pasta runs as the unprivileged uid that owns the box's user namespace, with no
   port forwarding in either direction (its default, ``auto``, would mirror the host's
   listening ports into the box). The gateway address maps to the host's loopback only
   when ``allow_private`` covers loopback; otherwise ``--no-map-gw`` is passed *and* the
   rules reject the gateway, so the host's loopback is unreachable twice over.

DNS: the box's ``/etc/resolv.conf`` names :data:`DNS_ADDRESS`, which pasta forwards to the
host's first resolver (the host's own resolver may be on a private address the box may not
reach directly). pasta daemonises once the interface is up; its pid file lets ``close()``
and the orphan sweep end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from corral.backends.host import dropids, mounts
from corral.backends.host.threads import blocking
from corral.errors import BackendError
from corral.net.rules import BLOCKED_V4, BLOCKED_V6, AddressScreen, IPNetwork

DNS_ADDRESS = "169.254.0.53"
"""What the box's resolv.conf names; pasta forwards it to the host's resolver."""
PASTA_TIMEOUT = 10.0
LOOPBACK_V4 = ipaddress.ip_network("127.0.0.0/8")


def missing_tools() -> list[str]:
    """What ``full`` mode needs and this host lacks (with the package to install)."""
    missing = []
    if shutil.which("pasta") is None:
        missing.append("pasta (apt-get install passt)")
    if shutil.which("nft") is None:
        missing.append("nft (apt-get install nftables)")
    if shutil.which("nsenter") is None:
        missing.append("nsenter (apt-get install util-linux)")
    return missing


def host_loopback_allowed(screen: AddressScreen) -> bool:
    """Whether ``allow_private`` opens (part of) 127.0.0.0/8: then the gateway maps to it."""
    return any(net.version == 4 and net.overlaps(LOOPBACK_V4) for net in screen.allowed)


def _set(nets: list[str]) -> str:
    return "{ " + ", ".join(nets) + " }"


def nft_ruleset(screen: AddressScreen, gateways: list[str]) -> str:
    """The table loaded into the box's netns (pure, so it is unit-tested)."""
    allowed: list[IPNetwork] = list(screen.allowed)
    v4_allow = [str(n) for n in allowed if n.version == 4]
    v6_allow = [str(n) for n in allowed if n.version == 6]
    lines = [
        "table inet corral {",
        "  chain output {",
        "    type filter hook output priority 0; policy accept;",
        '    oifname "lo" accept',
        f"    ip daddr {DNS_ADDRESS} udp dport 53 accept",
        f"    ip daddr {DNS_ADDRESS} tcp dport 53 accept",
    ]
    if host_loopback_allowed(screen):
        # The gateway stands for the host's loopback (pasta maps it): allowed by the policy.
        for gw in gateways:
            family = "ip" if ipaddress.ip_address(gw).version == 4 else "ip6"
            lines.append(f"    {family} daddr {gw} accept")
    if v4_allow:
        lines.append(f"    ip daddr {_set(v4_allow)} accept")
    if v6_allow:
        lines.append(f"    ip6 daddr {_set(v6_allow)} accept")
    lines += [
        f"    ip daddr {_set(list(BLOCKED_V4))} meta l4proto tcp reject with tcp reset",
        f"    ip daddr {_set(list(BLOCKED_V4))} reject",
        f"    ip6 daddr {_set(list(BLOCKED_V6))} meta l4proto tcp reject with tcp reset",
        f"    ip6 daddr {_set(list(BLOCKED_V6))} reject",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def host_gateways() -> list[str]:
    """The host's default gateways (pasta gives the box the same ones)."""
    gateways: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 2 and fields[1] == "00000000":
                raw = int(fields[2], 16)
                gateways.append(str(ipaddress.IPv4Address(raw.to_bytes(4, "little"))))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/ipv6_route").read_text().splitlines():
            fields = line.split()
            if len(fields) > 4 and fields[0] == "0" * 32 and fields[1] == "00":
                gw = ipaddress.IPv6Address(int(fields[4], 16))
                if not gw.is_unspecified:
                    gateways.append(str(gw))
    return gateways


async def _run(argv: list[str], log: Path, stdin: bytes = b"") -> tuple[int, str]:
    """Run a helper to completion; its stderr goes to ``log`` (a pipe would be held open by
    pasta's daemonised child)."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
    try:
        async with asyncio.timeout(PASTA_TIMEOUT):
            await proc.communicate(stdin)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, f"{argv[0]} timed out after {PASTA_TIMEOUT:.0f}s"
    return proc.returncode or 0, _tail(log)


def _tail(log: Path) -> str:
    """The end of a helper's (small) log file, for an error message."""
    with contextlib.suppress(OSError), log.open("rb") as f:
        return f.read()[-2000:].decode(errors="replace").strip()
    return ""


def _write_maps(pid: int, uid_map: str, gid_map: str) -> None:
    Path(f"/proc/{pid}/uid_map").write_text(uid_map)
    Path(f"/proc/{pid}/gid_map").write_text(gid_map)


class Nat:
    """pasta attached to one box's network namespace."""

    def __init__(self, screen: AddressScreen, state_dir: Path, runas: int) -> None:
        self.screen = screen
        self.pid_file = state_dir / "pasta.pid"
        self.log = state_dir / "nat.log"
        self.runas = runas
        self.pid: int | None = None
        self.pasta_pid: int | None = None
        self.userns_file = state_dir / "userns"
        self.netns_file = state_dir / "netns"
        self.held = False
        """Whether corral made the namespace itself (``make_netns``): pasta joins it by path."""

    async def fence(self, pid: int) -> None:
        """Load the nftables rules into the netns of ``pid`` (before the box runs anything).

        Rootless (corral is not root): nft runs in the box's user namespace too, which the
        user owns, so it holds CAP_NET_ADMIN over the box's network namespace there (and
        nowhere else), as box root: a command of another uid keeps no capability on exec."""
        userns = f"/proc/{pid}/ns/user" if os.geteuid() != 0 else None
        await self._fence(f"/proc/{pid}/ns/net", userns)
        self.pid = pid

    async def _fence(self, netns: str, userns: str | None = None) -> None:
        missing = missing_tools()
        if missing:
            raise BackendError(
                "network.mode 'full' needs " + ", ".join(missing) + "; install it, or use "
                "network.mode 'allowlist' (run `corral doctor` to see what works here)"
            )
        rules = nft_ruleset(self.screen, host_gateways())
        enter = [] if userns is None else [f"--user={userns}", *_keep_ids(userns)]
        nsenter = ["nsenter", *enter, f"--net={netns}", "nft", "-f", "-"]
        code, err = await _run(nsenter, self.log, rules.encode())
        if code != 0:
            raise BackendError(f"cannot fence the box's network with nftables: {err}")

    async def make_netns(self, id_maps: tuple[str, str] | None = None) -> str:
        """A fenced network namespace for a runtime that joins one by path (OCI).

        It lives in a user namespace owned by ``runas``, so pasta, running as that uid, may
        enter it; bind mounts on two files of the state directory hold both namespaces once
        the short-lived process that made them is gone. ``id_maps`` (uid_map, gid_map
        text): written to that user namespace, which the box then joins as its own (the
        runtime may only enter a network namespace of the user namespace it is in).
        Returns the netns path."""
        # As ``runas`` through an exec'd id dropper, not subprocess's user=/group=: those
        # fork this whole process on the event loop, holding the GIL (30-180 ms measured).
        drop = await blocking(dropids.as_uid, self.runas)
        ids: dict[str, Any] = (
            {} if drop else {"user": self.runas, "group": self.runas, "extra_groups": []}
        )
        holder = await asyncio.create_subprocess_exec(
            *(drop or ()),
            "unshare",
            "--user",
            "--net",
            "--",
            "/bin/sh",
            "-c",
            "echo; exec cat",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            **ids,
        )
        try:
            assert holder.stdout is not None
            async with asyncio.timeout(PASTA_TIMEOUT):
                if not await holder.stdout.readline():
                    raise BackendError("cannot create a network namespace (unshare failed)")
            if id_maps is not None:  # two short procfs writes
                _write_maps(holder.pid, *id_maps)
            for name, target in (("user", self.userns_file), ("net", self.netns_file)):
                target.touch(mode=0o444)
                mounts.bind(f"/proc/{holder.pid}/ns/{name}", str(target), recursive=False)
            self.held = True
        finally:
            if holder.returncode is None:
                holder.kill()
            await holder.wait()
        await self._fence(str(self.netns_file))
        code, err = await _run(
            ["nsenter", f"--net={self.netns_file}", "ip", "link", "set", "lo", "up"], self.log
        )
        if code != 0:
            raise BackendError(f"cannot bring up loopback in the box's network: {err}")
        return str(self.netns_file)

    def release_netns(self) -> None:
        """Drop the bind mounts holding a namespace made by ``make_netns`` (idempotent)."""
        for target in (self.netns_file, self.userns_file):
            mounts.umount_all(str(target))
        self.held = False

    async def connect(self) -> None:
        """Attach pasta. After the agent is up: bwrap sets up loopback itself just before it
        execs the agent, and fails if pasta has brought ``lo`` up first."""
        if self.pid is None and not self.held:
            raise BackendError("the box's network was not fenced before pasta was attached")
        argv = [
            "pasta",
            "--config-net",
            "--quiet",
            "--runas",
            f"{self.runas}:{self.runas}",
            "--pid",
            str(self.pid_file),
            "--dns-forward",
            DNS_ADDRESS,
            "-t",
            "none",
            "-u",
            "none",
            "-T",
            "none",
            "-U",
            "none",
        ]
        if not host_loopback_allowed(self.screen):
            argv.append("--no-map-gw")
        # pasta writes its pid file after dropping to ``runas``: give it a file it may write.
        self.pid_file.touch(mode=0o644)
        if os.geteuid() == 0:
            os.chown(self.pid_file, self.runas, self.runas)
        else:  # rootless: pasta runs as the user, who owns the box's user namespace
            at = argv.index("--runas")
            del argv[at : at + 2]
        if self.held:
            target = ["--userns", str(self.userns_file), "--netns", str(self.netns_file)]
        else:
            target = [str(self.pid)]
        code, err = await _run([*argv, *target], self.log)
        with contextlib.suppress(OSError, ValueError):
            self.pasta_pid = int(self.pid_file.read_text().strip())
        if code != 0:
            raise BackendError(f"pasta could not attach to the box's network namespace: {err}")

    async def close(self) -> None:
        """End pasta (by the pid read at start: the state directory may be gone by now) and
        wait until it has exited."""
        pid, self.pasta_pid = self.pasta_pid, None
        if pid is None:
            kill_pasta(self.pid_file)
            self.release_netns()
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            self.release_netns()
            return  # already gone
        try:
            if kill_pasta_pid(pid):
                await _readable(pidfd, timeout=5.0)
        finally:
            os.close(pidfd)
            self.release_netns()


def _keep_ids(userns: str) -> list[str]:
    """nsenter's option to keep this process's ids in the box's user namespace when that
    namespace maps this uid to its root (a rootless box with one id: it has no other id, and
    its ``setgroups`` is denied), else nothing (nsenter becomes box root there)."""
    pid_dir = os.path.dirname(os.path.dirname(userns))
    try:
        first = Path(pid_dir, "uid_map").read_text().split()
    except OSError:
        return []
    return ["--preserve-credentials"] if first[:2] == ["0", str(os.getuid())] else []


async def _readable(fd: int, timeout: float) -> None:
    """Wait for ``fd`` (a pidfd: readable once the process exited), at most ``timeout``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_exit)
    try:
        async with asyncio.timeout(timeout):
            await done
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)


def kill_pasta_pid(pid: int) -> bool:
    """SIGKILL ``pid`` if it is pasta (pids are reused); whether it was sent."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    if not comm.startswith(("pasta", "passt")):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def kill_pasta(pid_file: Path) -> None:
    """End the pasta named by ``pid_file``, if any (the orphan sweep's way)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    kill_pasta_pid(pid)
