"""Network modes on the microVM backend: no NIC, forwarders over the ``corral-net`` port.

One VM per mode (a TCG boot takes seconds). Test names (``allowed.test``) resolve to
127.0.0.1 through the proxy's static resolver and are opened with ``allow_private``: no test
sends traffic anywhere but the host's loopback. The link's protocol rules are checked in
``tests/test_vmlink.py``; this module checks the wiring in a real VM.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from corral import Policy, Sandbox
from corral.audit import read_records
from corral.backends import unavailable_reason
from corral.backends.host.state import state_root
from corral.errors import BackendUnavailable
from corral.net import StaticResolver
from loopback_http import LoopbackHttp, echo_path
from test_publish import echo, start_echo

VM = {"cpus": 2, "memory_mb": 384}  # the shape of tests/test_microvm.py: one saved VM for both
LIMITS = {"memory_bytes": 192 << 20}  # what a VM of 384 MiB holds beside the guest itself
SKIP = unavailable_reason(Policy(backend="microvm", vm=VM, limits=LIMITS))
NAMES = StaticResolver({"allowed.test": "127.0.0.1"})
BIG = 3 << 20

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=f"microvm backend unavailable: {SKIP}"),
    pytest.mark.asyncio(loop_scope="module"),
]


def body(head: bytes) -> bytes:
    return b"z" * BIG if head.split(b" ")[1] == b"/big" else echo_path(head)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[LoopbackHttp]:
    srv = await LoopbackHttp(body).start()
    yield srv
    await srv.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def other_server() -> AsyncIterator[LoopbackHttp]:
    srv = await LoopbackHttp().start()
    yield srv
    await srv.close()


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vm-net") / "audit.jsonl"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def allowlist_vm(
    tmp_path_factory: pytest.TempPathFactory, audit_log: Path
) -> AsyncIterator[Sandbox]:
    network = {"mode": "allowlist", "allow_hosts": ["allowed.test"], "allow_private": ["127.0.0.1"]}
    policy = Policy(backend="microvm", vm=VM, limits=LIMITS, network=network, audit_log=audit_log)
    sb = Sandbox(policy, workspace=tmp_path_factory.mktemp("ws-allow"), resolver=NAMES)
    await sb.start()
    yield sb
    await sb.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ports_vm(
    tmp_path_factory: pytest.TempPathFactory, server: LoopbackHttp
) -> AsyncIterator[Sandbox]:
    policy = Policy(
        backend="microvm",
        vm=VM,
        limits=LIMITS,
        network={"mode": "ports", "ports": [server.port], "publish": ["0:8000"]},
    )
    sb = Sandbox(policy, workspace=tmp_path_factory.mktemp("ws-ports"))
    await sb.start()
    yield sb
    await sb.aclose()


# ---- allowlist ----------------------------------------------------------------------------


async def test_curl_reaches_an_allowed_host_every_way(
    allowlist_vm: Sandbox, server: LoopbackHttp
) -> None:
    url = f"http://allowed.test:{server.port}"
    for cmd in (
        f"curl -sS {url}/plain",  # absolute-form GET through HTTP_PROXY
        f"curl -sS -p {url}/tunnel",  # CONNECT
        f"curl -sS --proxy $ALL_PROXY {url}/socks",  # SOCKS5
    ):
        r = await allowlist_vm.run(cmd, timeout=60)
        assert r.exit_code == 0, (cmd, r.stderr)
        assert r.stdout == f"hello /{cmd.rsplit('/', 1)[1]}\n", r.stdout


async def test_a_denied_host_gets_403_and_is_audited(
    allowlist_vm: Sandbox, server: LoopbackHttp, audit_log: Path
) -> None:
    hits = server.hits
    r = await allowlist_vm.run(
        f"curl -sS -w '%{{http_code}}' http://denied.test:{server.port}/x", timeout=60
    )
    assert r.stdout.endswith("403"), r.stdout
    assert "denied.test" in r.stdout and "network.allow_hosts" in r.stdout
    assert server.hits == hits
    denials = [
        rec["host"]
        for rec in read_records(audit_log)
        if rec["kind"] == "network" and rec["action"] == "deny"
    ]
    assert denials == ["denied.test"]


async def test_megabytes_and_parallel_requests_through_the_link(
    allowlist_vm: Sandbox, server: LoopbackHttp
) -> None:
    url = f"http://allowed.test:{server.port}"
    r = await allowlist_vm.run(f"curl -sS {url}/big | wc -c", timeout=120)
    assert r.stdout.strip() == str(BIG), r.stderr
    script = (
        f"for i in $(seq 16); do curl -sS {url}/p$i > /tmp/p$i & done; wait; "
        "cat $(for i in $(seq 16); do echo /tmp/p$i; done)"
    )
    r = await allowlist_vm.run(script, timeout=120)
    assert r.stdout.splitlines() == [f"hello /p{i}" for i in range(1, 17)], r.stderr


async def test_python_and_node_use_the_proxy(allowlist_vm: Sandbox, server: LoopbackHttp) -> None:
    url = f"http://allowed.test:{server.port}"
    code = f"import urllib.request; print(urllib.request.urlopen('{url}/py').read().decode())"
    r = await allowlist_vm.run(["python3", "-c", code], timeout=60)
    assert r.stdout.strip() == "hello /py", r.stderr
    r = await allowlist_vm.run("wc -c < /run/corral-net/node_proxy.js", timeout=30)
    assert int(r.stdout) > 0  # NODE_OPTIONS' preload exists in the VM
    if shutil.which("node") is None:
        return
    js = f"fetch('{url}/node').then(r => r.text()).then(t => process.stdout.write(t))"
    r = await allowlist_vm.run(["node", "-e", js], timeout=120)
    assert r.stdout.strip() == "hello /node", r.stderr


async def test_no_nic_and_no_direct_route(allowlist_vm: Sandbox, server: LoopbackHttp) -> None:
    r = await allowlist_vm.run(["ls", "/sys/class/net"], timeout=30)
    assert r.stdout.split() == ["lo"]
    hits = server.hits
    r = await allowlist_vm.run(
        f"curl -sS --noproxy '*' http://127.0.0.1:{server.port}/", timeout=60
    )
    assert r.exit_code == 7  # the VM's loopback is its own
    assert server.hits == hits


async def test_commands_cannot_open_the_link_device(allowlist_vm: Sandbox) -> None:
    r = await allowlist_vm.run("echo x > /dev/corral-net && echo opened || echo refused")
    assert r.stdout.strip() == "refused", r.stdout + r.stderr


# ---- ports --------------------------------------------------------------------------------


async def test_ports_mode_reaches_exactly_the_listed_port(
    ports_vm: Sandbox, server: LoopbackHttp, other_server: LoopbackHttp
) -> None:
    for host in ("127.0.0.1", "localhost"):
        r = await ports_vm.run(f"curl -sS http://{host}:{server.port}/in", timeout=60)
        assert r.stdout == "hello /in\n", r.stderr
    r = await ports_vm.run(f"curl -sS http://127.0.0.1:{other_server.port}/", timeout=60)
    assert r.exit_code == 7
    assert other_server.hits == 0
    r = await ports_vm.run("env", timeout=30)
    assert "proxy" not in r.stdout.lower()
    r = await ports_vm.run(["ls", "/sys/class/net"], timeout=30)
    assert r.stdout.split() == ["lo"]


async def test_a_published_vm_port_is_reached_from_the_host(ports_vm: Sandbox) -> None:
    """``publish`` in a VM: the agent dials the host through the link (no NIC, no socket)."""
    await start_echo(ports_vm, 8000)
    port = ports_vm.published[0].port_on_host
    blob = os.urandom(1 << 20)
    assert await asyncio.to_thread(echo, port, blob) == blob
    payloads = [os.urandom(50_000 + i) for i in range(4)]
    got = await asyncio.gather(*(asyncio.to_thread(echo, port, p) for p in payloads))
    assert got == payloads


async def test_closing_ends_the_link_and_leaves_nothing(ports_vm: Sandbox) -> None:
    state = state_root() / "boxes" / ports_vm.sandbox_id
    assert ports_vm._box is not None
    link = ports_vm._box._netlink  # type: ignore[attr-defined]
    assert link is not None and link.reason is None
    await ports_vm.aclose()
    assert link.reason == "closed by the host"
    assert not state.exists()


# ---- full ---------------------------------------------------------------------------------


async def test_full_mode_is_refused_with_the_reason() -> None:
    from corral.backends.microvm.box import MicroVmBackend

    with pytest.raises(BackendUnavailable, match=r"no NIC.*'allowlist'"):
        MicroVmBackend(Policy(backend="microvm", network={"mode": "full"}))
