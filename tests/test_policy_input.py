"""Policy input as users write it: errors in corral's words, a policy given as a file, a
string where a list is expected, relative paths resolved against the workspace, and a bad
rlimit name refused before it reaches the box."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import corral
from corral import Policy, PolicyError, Sandbox
from corral.errors import ErrorCode
from corral.policy import FilesystemPolicy, Limits, Mount


def test_a_bad_field_is_a_policy_error_naming_it() -> None:
    with pytest.raises(PolicyError) as info:
        Policy(limits={"cpu_quota": -1})
    assert isinstance(info.value, ValueError)
    assert info.value.code is ErrorCode.INVALID_POLICY
    assert "limits.cpu_quota" in info.value.message
    assert "pydantic" not in str(info.value)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Limits(max_pids=1),
        lambda: FilesystemPolicy(tmp_size=-1),
        lambda: Mount(host=Path("/tmp"), guest="relative"),
        lambda: Policy(bogus=1),  # type: ignore[call-arg]
    ],
)
def test_every_policy_model_raises_policy_error(build: object) -> None:
    with pytest.raises(PolicyError, match="invalid policy: "):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_bytes", 2**64 + (64 << 20)),  # a cgroup took it as 64 MiB (wrapped)
        ("memory_bytes", 10**30),
        ("memory_bytes", "9P"),
        ("output_bytes", 10**20),
    ],
)
def test_a_size_beyond_any_machine_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(PolicyError, match=f"limits.{field}: more than 8 PiB"):
        Policy.from_dict({"limits": {field: value}})
    assert Policy.from_dict({"limits": {field: "8P"}}).limits.model_dump()[field] == 1 << 53


def test_a_string_where_a_list_is_expected_is_one_entry() -> None:
    p = Policy.from_dict(
        {
            "filesystem": {"deny_read": "~/.ssh", "allow_write": "/srv/out"},
            "network": {"allow_hosts": "pypi.org", "ports": 8080},
        }
    )
    assert p.filesystem.deny_read == ("~/.ssh",)
    assert p.filesystem.allow_write == ("/srv/out",)
    assert p.network.allow_hosts == ("pypi.org",)
    assert p.network.ports == (8080,)


def test_relative_paths_resolve_against_the_workspace(tmp_path: Path) -> None:
    p = Policy(
        filesystem=FilesystemPolicy(
            allow_write=(".", "build", "../shared", "/srv/x", "~/cache"),
            mounts=(Mount(host=Path("data"), guest="/data"),),
        )
    )
    ws = tmp_path / "ws"
    r = p.for_workspace(ws)
    # Inside the workspace: writable already; outside: absolute; anchored: unchanged.
    assert r.filesystem.allow_write == (str(tmp_path / "shared"), "/srv/x", "~/cache")
    assert r.filesystem.mounts[0].host == ws / "data"
    plain = Policy()
    assert plain.for_workspace(ws) is plain


def test_policy_files_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "p.toml"
    toml.write_text('[filesystem]\ndeny_read = "~/.ssh"\n[limits]\nmax_pids = 64\n')
    assert Policy.load(toml).limits.max_pids == 64
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"limits": {"max_pids": 32}}))
    assert Policy.load(js).limits.max_pids == 32
    assert Sandbox(policy=str(js)).policy.limits.max_pids == 32
    assert Sandbox(policy=toml).policy.filesystem.deny_read == ("~/.ssh",)
    with pytest.raises(PolicyError, match="not found"):
        Sandbox(policy=str(tmp_path / "missing.toml"))
    with pytest.raises(PolicyError, match="is a directory"):
        Policy.load(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(PolicyError, match="table of fields"):
        Policy.load(bad)
    with pytest.raises(PolicyError, match=r"corral\.Policy or the path"):
        Sandbox(policy=42)  # type: ignore[arg-type]


async def test_allow_write_dot_starts_and_the_workspace_is_writable(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    policy = Policy(filesystem=FilesystemPolicy(allow_write=(".",)))
    async with Sandbox(policy, workspace=ws) as sb:
        r = await sb.run("echo hi > made && cat made")
    assert r.exit_code == 0, r.stderr
    assert (ws / "made").read_text() == "hi\n"


async def test_a_bad_rlimit_name_is_a_policy_error(tmp_path: Path) -> None:
    async with Sandbox(workspace=tmp_path) as sb:
        with pytest.raises(PolicyError, match=r"rlimits\.Nofile: unknown rlimit"):
            await sb.run("true", rlimits={"Nofile": 10})  # type: ignore[dict-item]
        with pytest.raises(PolicyError, match=r"rlimits\.nofile"):
            await sb.run("true", rlimits={"nofile": -1})
        r = await sb.run("ulimit -n", rlimits={"nofile": 77})
    assert r.stdout.strip() == "77"


def test_policy_error_is_exported() -> None:
    assert corral.PolicyError is PolicyError


@pytest.mark.parametrize("backend", ["bwrap", "oci", "microvm"])
async def test_a_shared_path_that_does_not_exist_is_refused_naming_the_field(
    tmp_path: Path, backend: str
) -> None:
    # Each backend used to fail at start with its own words (bwrap "Can't find source path",
    # crun "error stat'ing file", qemu's jail) as backend_failed, or, for allow_write, with a
    # message about links: the policy names a path the host does not have.
    ws = tmp_path / "ws"
    ws.mkdir()
    missing = tmp_path / "missing"
    for fs, field in [
        ({"mounts": [{"host": str(missing), "guest": "/data"}]}, "filesystem.mounts[0].host"),
        ({"allow_write": [str(missing)]}, "filesystem.allow_write[0]"),
    ]:
        sb = Sandbox(Policy(backend=backend, filesystem=fs), workspace=ws)
        with pytest.raises(PolicyError) as info:
            async with sb:
                pass
        assert field in info.value.message
        assert f"{missing} does not exist" in info.value.message


@pytest.mark.parametrize(
    ("guest", "says"),
    [
        ("/workspace", "filesystem.mounts[0].guest: /workspace is the workspace"),
        ("/workspace/sub/", "/workspace/sub/ is inside the workspace"),
        ("/proc", "guest path /proc is the box's own"),
        ("/dev/shm", "guest path /dev/shm is the box's own"),
        ("/", "guest path / is the box's own"),
        ("/run/corral/agent", "is the box's own"),
        ("//sys/../sys", "is the box's own"),
    ],
)
def test_a_mount_over_what_the_box_already_has_is_refused(
    tmp_path: Path, guest: str, says: str
) -> None:
    # -v HOST:/workspace hid the workspace behind a read-only mount; over /proc or /dev it
    # replaced them, or failed as a generic backend error.
    with pytest.raises(PolicyError, match=re.escape(says)):
        Policy.from_dict({"filesystem": {"mounts": [{"host": str(tmp_path), "guest": guest}]}})
    ok = {"host": str(tmp_path), "guest": "/mnt/data"}
    assert Policy.from_dict({"filesystem": {"mounts": [ok]}}).filesystem.mounts[0].guest


def test_sharing_the_host_root_is_refused() -> None:
    # It failed late with an idmap error that blamed the workspace's owner.
    for host in ("/", "//", "/."):
        with pytest.raises(PolicyError, match="host path / would share the whole host"):
            Policy.from_dict({"filesystem": {"mounts": [{"host": host, "guest": "/host"}]}})


def test_a_mount_of_a_masked_host_path_is_refused_naming_the_mask(tmp_path: Path) -> None:
    # -v /root:/r failed with "swapped in by another box?" (a mask pinned under a mask).
    for host in ("/root", os.path.expanduser("~/.ssh")):
        with pytest.raises(PolicyError, match=r"is masked by filesystem\.deny_read"):
            Policy.from_dict({"filesystem": {"mounts": [{"host": host, "guest": "/r"}]}})
    shared = {"deny_read": ["/etc/shadow"], "mounts": [{"host": "/root", "guest": "/r"}]}
    assert Policy.from_dict({"filesystem": shared}).filesystem.mounts  # unmasked: fine
    below = {"mounts": [{"host": "/root/.pyenv", "guest": "/root/.pyenv"}]}  # as presets do
    assert Policy.from_dict({"filesystem": below}).filesystem.mounts
