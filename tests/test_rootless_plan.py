"""The rootless bwrap mode's pure parts: its id maps, its bwrap options, its limit fallback,
what it finds in /etc/subuid, and the causes it names when a box cannot start.

Real rootless boxes run in tests/rootless/ as an unprivileged user (tests/test_rootless.py
switches to it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from corral import Policy
from corral.backends import effective_backend
from corral.backends.bwrap.args import BwrapFds, BwrapInputs, bwrap_argv
from corral.backends.bwrap.rootless import rootless_argv
from corral.backends.host import cgroups, subids
from corral.backends.host.subids import NO_CGROUP
from corral.backends.layout import GUEST_AGENT_DIR
from corral.backends.limits import Capabilities, plan_limits
from corral.backends.users import BOX_UID, ID_RANGE, rootless_ranges
from corral.policy import Limits

RLIMITS = Capabilities("rlimits", controllers=frozenset(), reason=NO_CGROUP)


def _argv() -> list[str]:
    inputs = BwrapInputs(
        workspace=Path("/ws"),
        agent_dir=Path("/opt/corral/agent"),
        python="/usr/bin/python3.11",
        masked_file=Path("/tmp/corral-1000/shared/masked-file"),
        masked_dir=Path("/tmp/corral-1000/shared/masked-dir"),
        passwd_file=Path("/tmp/corral-1000/shared/passwd"),
        fds=BwrapFds(info=5, userns_block=6, seccomp=7),
        agent_args=("{}",),
    )
    return bwrap_argv(Policy(), inputs)


def test_with_subordinate_ids_commands_are_the_user_and_the_rest_subordinate() -> None:
    ranges = rootless_ranges(1234, 100000)
    assert ranges == [(0, 100000, BOX_UID), (BOX_UID, 1234, 1), (1001, 101000, 64535)]
    # Every box id is mapped once, and no host id twice; all but the user's fit the range.
    assert sum(count for _, _, count in ranges) == ID_RANGE
    subordinate = [(host, count) for box, host, count in ranges if box != BOX_UID]
    assert all(host >= 100000 and host + count <= 100000 + 65536 for host, count in subordinate)


def test_without_subordinate_ids_one_id_is_mapped() -> None:
    assert rootless_ranges(1234, None) == [(0, 1234, 1)]


def test_mapped_mode_runs_bwrap_as_the_command_user_and_opens_the_agents_parent() -> None:
    argv = rootless_argv(_argv(), mapped=True)
    options = argv[: argv.index("--")]
    assert options[options.index("--uid") + 1] == str(BOX_UID)
    assert options[options.index("--gid") + 1] == str(BOX_UID)
    assert "CAP_SETUID" in options  # the agent takes box root with it
    parent = options.index("/run/corral")
    assert options[parent - 3 : parent] == ["--perms", "0755", "--dir"]
    assert parent < options.index(GUEST_AGENT_DIR)
    assert argv[argv.index("--") :] == _argv()[_argv().index("--") :]
    # /run is bwrap's, so the commands' uid's: read-only once the box is built.
    assert options[options.index("/run", options.index("--remount-ro")) - 1] == "--remount-ro"


def test_a_writable_image_root_keeps_run_sealed_and_the_interpreter_reachable(
    tmp_path: Path,
) -> None:
    """On a writable image root (the overlay bound as ``/``, no ``--remount-ro /``) /run is
    still sealed, and the hidden interpreter's parent is made listable for the agent."""
    from corral.backends.host.python import HOST_PREFIX, HiddenPython

    hidden = HiddenPython("/usr", (HOST_PREFIX + "/usr/lib/ld.so", HOST_PREFIX + "/usr/bin/py"))
    (tmp_path / "etc").mkdir()
    inputs = BwrapInputs(
        workspace=Path("/ws"),
        agent_dir=Path("/opt/corral/agent"),
        python="/usr/bin/python3.11",
        masked_file=Path("/tmp/corral-1000/shared/masked-file"),
        masked_dir=Path("/tmp/corral-1000/shared/masked-dir"),
        passwd_file=Path("/tmp/corral-1000/shared/passwd"),
        fds=BwrapFds(info=5, userns_block=6, seccomp=7),
        agent_args=("{}",),
        image_root=tmp_path,
        image_writable=True,
        hidden=hidden,
    )
    argv = rootless_argv(bwrap_argv(Policy(image=str(tmp_path)), inputs), mapped=True)
    options = argv[: argv.index("--")]
    assert options[options.index("--remount-ro") + 1] == "/run"
    assert "/" not in [options[i + 1] for i, o in enumerate(options) if o == "--remount-ro"]
    prefix = options.index(HOST_PREFIX)
    assert options[prefix - 3 : prefix] == ["--perms", "0755", "--dir"]
    assert prefix < options.index(HOST_PREFIX + "/usr")


def test_single_id_mode_keeps_no_capability() -> None:
    argv = rootless_argv(_argv(), mapped=False)
    options = argv[: argv.index("--")]
    assert "--cap-add" not in options
    assert options[options.index("--uid") + 1] == "0"


def test_rlimit_fallback_bounds_memory_and_processes_and_names_each_gap() -> None:
    plan = plan_limits(Limits(memory_bytes=256 << 20, cpu_quota=0.5, max_pids=64), RLIMITS)
    assert plan.mechanism == "rlimits"
    assert plan.rlimits["as"] == 256 << 20
    assert plan.rlimits["nproc"] == 64
    assert plan.unenforced == {"memory_bytes", "cpu_quota", "max_pids"}
    text = " | ".join(plan.warnings)
    assert "limits.memory_bytes enforced per process only (RLIMIT_AS" in text
    assert "limits.max_pids enforced as RLIMIT_NPROC 64" in text
    assert "limits.cpu_quota not enforced: rootless" in text
    assert plan.describe()["limits_enforced_by"] == "rlimits"


def test_a_policys_own_rlimit_wins_over_the_fallback() -> None:
    limits = Limits(memory_bytes=256 << 20, rlimits={"as": 1 << 30})
    assert plan_limits(limits, RLIMITS).rlimits["as"] == 1 << 30


def test_subuid_ranges_are_found_by_name_or_uid(tmp_path: Path) -> None:
    table = tmp_path / "subuid"
    table.write_text("other:1:65536\nalice:100000:1000\n1234:200000:65536\n")
    assert subids._ranges(str(table), "alice", 1234) == [(100000, 1000), (200000, 65536)]
    assert subids._first_big(subids._ranges(str(table), "alice", 1234)) == (200000, 65536)
    assert subids._first_big([(100000, 1000)]) == (None, 1000)


@pytest.mark.parametrize(
    ("knob", "value", "fix"),
    [
        ("/proc/sys/user/max_user_namespaces", 0, "sysctl -w user.max_user_namespaces=15000"),
        (
            "/proc/sys/kernel/unprivileged_userns_clone",
            0,
            "sysctl -w kernel.unprivileged_userns_clone=1",
        ),
        (
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            1,
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
        ),
    ],
)
def test_disabled_user_namespaces_are_named_with_the_root_command_that_fixes_them(
    monkeypatch: pytest.MonkeyPatch, knob: str, value: int, fix: str
) -> None:
    monkeypatch.setattr(subids, "_read_int", lambda path: value if path == knob else None)
    problem = subids.userns_problem()
    assert problem is not None and fix in problem


def test_missing_helpers_and_ranges_are_named_with_their_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    assert "apt-get install uidmap" in (subids.probe().separation_problem or "")
    monkeypatch.setattr(shutil, "which", lambda name, **k: f"/usr/bin/{name}")
    monkeypatch.setattr(subids, "read_subids", lambda user, uid: subids.SubIds(None, 0, 5, 65536))
    problem = subids.probe().separation_problem or ""
    assert "/etc/subuid" in problem and "/etc/subgid" not in problem
    assert "usermod --add-subuids 100000-165535 --add-subgids 100000-165535" in problem


def test_bwrap_means_rootless_for_an_ordinary_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert effective_backend(Policy()) == "bwrap-rootless"
    assert effective_backend(Policy(backend="oci")) == "oci"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert effective_backend(Policy()) == "bwrap"


def _fake_cgroup2(tmp_path: Path, own: str) -> tuple[str, str]:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"30 23 0:26 / {tmp_path}/cg rw,nosuid - cgroup2 cgroup2 rw\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    for group in ("cg/d", "cg/d/leaf"):
        (tmp_path / group).mkdir(parents=True, exist_ok=True)
        for name in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
            (tmp_path / group / name).touch()
    (tmp_path / "cg/d/cgroup.controllers").write_text("cpu memory pids hugetlb\n")
    (tmp_path / "cg/d/cgroup.subtree_control").write_text("pids\n")
    return str(mountinfo), str(self_cgroup)


def test_a_delegated_root_above_this_process_offers_its_controllers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_CGROUP_DELEGATE", str(tmp_path / "cg/d"))
    found = cgroups.delegated_v2(*_fake_cgroup2(tmp_path, "/d/leaf"))
    assert found is not None and found.root == str(tmp_path / "cg/d")
    assert found.controllers == {"cpu", "memory", "pids"}
    # A delegated root this process is not in: no common ancestor to move boxes through.
    assert cgroups.delegated_v2(*_fake_cgroup2(tmp_path, "/elsewhere")) is None


def test_its_own_group_offers_only_what_is_enabled_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CORRAL_CGROUP_DELEGATE", raising=False)
    found = cgroups.delegated_v2(*_fake_cgroup2(tmp_path, "/d"))
    assert found is not None and found.controllers == {"pids"}  # it holds this process


def test_missing_controllers_of_a_delegated_group_fall_back_to_rlimits() -> None:
    caps = Capabilities(
        "cgroup v2", controllers=frozenset({"pids"}), reason="delegated", rlimit_fallback=True
    )
    plan = plan_limits(Limits(memory_bytes=256 << 20, max_pids=64), caps)
    assert plan.rlimits["as"] == 256 << 20 and "nproc" not in plan.rlimits
    assert plan.unenforced == {"memory_bytes"}
    assert plan.pids_max == 64
