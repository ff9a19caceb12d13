"""Landlock, the second filesystem layer: the rules the host sends (pure), and real boxes where
the kernel enforces them (reported in ``info()``, turned off by the policy)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from corral.backends import landlock
from corral.backends.layout import GUEST_AGENT_DIR
from corral.backends.microvm.box import MICROVM_NO_LANDLOCK
from corral.policy import Mount

ABI, WHY_NOT = landlock.host_abi()
needs_landlock = pytest.mark.skipif(ABI < 2, reason=f"no Landlock ABI 2+ here: {WHY_NOT}")


def test_rules_mirror_the_layout() -> None:
    policy = Policy(
        filesystem={
            "allow_write": ["/srv/cache"],
            "mounts": [
                {"host": "/opt/data", "guest": "/data", "mode": "ro"},
                {"host": "/opt/out", "guest": "/out", "mode": "rw"},
            ],
        }
    )
    rules = landlock.rules(policy, sys.executable, ["/run/corral-net"], home="/home/u")
    assert rules["read"][0] == "/"  # its names only (the agent keeps READ_DIR there)
    for path in ("/usr", "/etc", "/bin", "/var/lib/dpkg", GUEST_AGENT_DIR, "/data"):
        assert path in rules["read"]
    assert "/run/corral-net" in rules["read"]
    assert str(Path(sys.executable).resolve().parent.parent) in rules["read"]
    assert rules["write"] == [
        "/workspace",
        "/tmp",
        "/home",
        "/dev",
        "/dev/mqueue",
        "/srv/cache",
        "/out",
    ]
    assert rules["proc"] == ["/proc"]
    # Host data is in neither list: only what the layout mounts on purpose.
    flat = rules["read"] + rules["write"]
    assert not {"/root", "/srv", "/mnt", "/var", "/media"} & set(flat)


def test_minimal_root_reads_only_what_it_mounts() -> None:
    policy = Policy(filesystem={"inherit_readable": False}, workdir="/code")
    rules = landlock.rules(policy, "/usr/bin/python3")
    assert "/etc" not in rules["read"] and "/opt" not in rules["read"]
    assert {"/usr", "/etc/ssl", "/etc/passwd", "/etc/ld.so.cache"} <= set(rules["read"])
    assert rules["write"][0] == "/code"


def test_allow_write_under_home_expands() -> None:
    policy = Policy(filesystem={"allow_write": ["~/.cache/pip"]})
    assert "/home/u/.cache/pip" in landlock.rules(policy, sys.executable, home="/home/u")["write"]


def test_off_switch() -> None:
    policy = Policy(security={"landlock": False})
    assert landlock.rules(policy, sys.executable) == {"off": landlock.OFF_BY_POLICY}


def test_host_abi_matches_the_kernel() -> None:
    abi, why = landlock.host_abi()
    assert (abi >= 1) == (why == "")


# ---- real boxes ----------------------------------------------------------------------------

STRAY = "/stray"
"""Where the tests bind a host directory read-write at the mount level while the Landlock
rules (from the intended layout) do not name it: a misconfigured mount."""


@pytest.fixture
def stray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host directory mounted rw at /stray, left out of the Landlock rules the backends
    send (the mount layer alone would let the box write it)."""
    from corral.backends.bwrap import box as bwrap_box
    from corral.backends.bwrap import rootless as rootless_box
    from corral.backends.oci import box as oci_box

    host = tmp_path / "stray"
    host.mkdir()
    (host / "secret").write_text("host data\n")
    host.chmod(0o777)
    (host / "secret").chmod(0o666)
    (host / "tool").write_text("#!/bin/sh\necho ran\n")
    (host / "tool").chmod(0o777)

    def without_stray(policy: Policy, python: str, extra: Any = (), **kw: Any) -> dict[str, Any]:
        rules = landlock.rules(policy, python, extra, **kw)
        if "write" in rules:
            rules["write"] = [p for p in rules["write"] if p != STRAY]
        return rules

    monkeypatch.setattr(bwrap_box, "landlock_rules", without_stray)
    monkeypatch.setattr(oci_box, "landlock_rules", without_stray)
    monkeypatch.setattr(rootless_box, "landlock_rules", without_stray)
    return host


def with_stray(policy: Policy, host: Path, **security: Any) -> Policy:
    mount = Mount(host=host, guest=STRAY, mode="rw")
    fs = policy.filesystem.model_copy(update={"mounts": (*policy.filesystem.mounts, mount)})
    update: dict[str, Any] = {"filesystem": fs}
    if security:
        update["security"] = policy.security.model_copy(update=security)
    return policy.model_copy(update=update)


@needs_landlock
async def test_info_reports_enforcement(sandbox: Sandbox) -> None:
    info = await sandbox.info()
    if sandbox.policy.runtime == "runsc":
        assert info["landlock"]["enforced"] is False and info["landlock"]["reason"]
        return
    if sandbox.policy.backend == "microvm":  # the guest's kernel and the VM are the boundary
        assert info["landlock"] == {"abi": 0, "enforced": False, "reason": MICROVM_NO_LANDLOCK}
        return
    assert info["landlock"] == {
        "abi": ABI,
        "enforced": True,
        **({"scoped": ["abstract_unix_socket", "signal"]} if ABI >= 6 else {}),
    }


@needs_landlock
async def test_a_stray_rw_mount_is_denied(box_policy: Policy, workspace: Path, stray: Path) -> None:
    if box_policy.runtime == "runsc":
        pytest.skip("gVisor's kernel has no Landlock")
    if box_policy.backend == "microvm":
        pytest.skip("a microVM applies no Landlock: the guest's kernel and the VM are the boundary")
    async with Sandbox(with_stray(box_policy, stray), workspace=workspace) as sb:
        write = await sb.run(["sh", "-c", f"echo x > {STRAY}/new"])
        assert write.exit_code != 0 and "Permission denied" in write.stderr
        read = await sb.run(["cat", f"{STRAY}/secret"])
        assert read.exit_code != 0 and "Permission denied" in read.stderr
        # What the layout means stays usable: the workspace, /tmp, the system view.
        ok = await sb.run(
            "echo w > /workspace/f && cat /workspace/f && echo t > /tmp/t && cat /tmp/t "
            "&& mkdir -p d && mv f d/ && head -c 4 /etc/os-release && ls / > /dev/null"
        )
        assert ok.exit_code == 0, ok.stderr
        assert ok.stdout.startswith("w\nt\n")
        # The file API acts as the command user, inside the same rules.
        assert (await sb.files.read_text("d/f")) == "w\n"
    assert not (stray / "new").exists()
    assert (workspace / "d" / "f").read_text() == "w\n"


@needs_landlock
async def test_off_switch_leaves_the_mounts_alone(
    box_policy: Policy, workspace: Path, stray: Path
) -> None:
    policy = with_stray(box_policy, stray, landlock=False)
    async with Sandbox(policy, workspace=workspace) as sb:
        info = await sb.info()
        why = MICROVM_NO_LANDLOCK if policy.backend == "microvm" else landlock.OFF_BY_POLICY
        assert info["landlock"] == {"abi": 0, "enforced": False, "reason": why}
        r = await sb.run(["sh", "-c", f"echo x > {STRAY}/new"])
        assert r.exit_code == 0, r.stderr  # the mount alone decides: it is rw
    assert (stray / "new").read_text() == "x\n"


@needs_landlock
async def test_a_warm_box_applies_its_rules_once_its_workspace_is_there(workspace: Path) -> None:
    """A pool's box starts on a staging directory and gets the workspace mounted over it when
    claimed: its rules are made then (a rule on the staging directory would not reach it)."""
    from corral import SandboxPool

    async with SandboxPool(Policy(), size=1) as pool:
        await pool.wait_idle()
        async with await pool.sandbox(workspace=workspace) as sb:
            r = await sb.run("echo x > f && cat f && mkdir d && mv f d/ && echo y > /tmp/t")
            assert r.exit_code == 0 and r.stdout == "x\n", r
            assert (await sb.info())["landlock"]["enforced"] is True
    assert (workspace / "d" / "f").read_text() == "x\n"


def test_the_agent_handles_every_right_its_abi_knows() -> None:
    from corral.agent import landlock as agent

    assert agent.handled_fs(1) == (1 << 13) - 1
    assert agent.handled_fs(2) & agent.REFER and not agent.handled_fs(2) & agent.TRUNCATE
    assert agent.handled_fs(4) == agent.handled_fs(3)  # ABI 4 adds network rights only
    assert agent.handled_fs(7) == (1 << 16) - 1
    assert agent.apply({"off": "why"}) == {"abi": 0, "enforced": False, "reason": "why"}
