"""The spec's SandboxConfig shape as an input format: each row of docs/spec-config.md's
mapping, the refusals, errors naming the spec's fields, and auto-detection in policy files."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, PolicyError, Sandbox, specconfig
from corral.policy import DEFAULT_DENY_READ

SPEC_EXAMPLE: dict[str, Any] = {
    "enabled": True,
    "isolation": "Namespace",
    "filesystem": {
        "allow_write": ["."],
        "deny_write": [],
        "deny_read": [],
        "inherit_readable": True,
    },
    "network": {"enabled": False},
    "security": {"standard": "Baseline"},
    "resources": {
        "memory_bytes": 512 * 1024 * 1024,
        "cpu_quota": 1.0,
        "max_pids": 64,
        "exec_timeout_secs": 30,
    },
    "process_tracking": {"enabled": True, "max_tracked": 64},
}


def test_the_spec_example_maps_onto_a_policy() -> None:
    p = Policy.from_spec_config(SPEC_EXAMPLE)
    assert p.backend == "bwrap" and p.runtime is None
    assert p.filesystem.allow_write == (".",)
    assert p.filesystem.deny_read == DEFAULT_DENY_READ  # [] adds nothing, unmasks nothing
    assert p.network.mode == "none"
    assert p.security.preset == "baseline"
    assert (p.limits.memory_bytes, p.limits.cpu_quota) == (512 << 20, 1.0)
    assert (p.limits.max_pids, p.limits.exec_timeout_secs) == (64, 30)
    assert (p.process_tracking.enabled, p.process_tracking.max_tracked) == (True, 64)
    assert Policy.from_dict(SPEC_EXAMPLE) == p  # found by its shape


@pytest.mark.parametrize(
    ("isolation", "backend", "runtime"),
    [
        ("namespace", "bwrap", None),
        ("Container", "oci", None),
        ("gVisor", "oci", "runsc"),
        ("MicroVM", "microvm", None),
    ],
)
def test_isolation_levels(isolation: str, backend: str, runtime: str | None) -> None:
    p = Policy.from_spec_config({"isolation": isolation})
    assert (p.backend, p.runtime) == (backend, runtime)


def test_network_and_security_rows() -> None:
    on = Policy.from_spec_config({"network": {"enabled": True}})
    assert on.network.mode == "full"
    allow = Policy.from_spec_config({"network": {"enabled": True, "allowed_domains": ["pypi.org"]}})
    assert (allow.network.mode, allow.network.allow_hosts) == ("allowlist", ("pypi.org",))
    assert Policy.from_spec_config({"security": {"standard": "standard"}}).security.preset == (
        "baseline"
    )
    restricted = Policy.from_spec_config({"security": {"standard": "Restricted"}})
    assert restricted.security.preset == "restricted"
    extra = Policy.from_spec_config({"filesystem": {"deny_read": "/srv/data"}, "enabled": True})
    assert extra.filesystem.deny_read == (*DEFAULT_DENY_READ, "/srv/data")


def test_corral_fields_stand_beside_the_spec() -> None:
    p = Policy.from_dict({"resources": {"max_pids": 32}, "limits": {"output_bytes": "2M"}})
    assert (p.limits.max_pids, p.limits.output_bytes) == (32, 2 << 20)
    plain = Policy.from_dict({"network": {"mode": "none"}})  # corral's own shape: not mapped
    assert plain.network.mode == "none"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"enabled": False}, r"enabled: False: corral always runs commands in a sandbox"),
        ({"isolation": "none"}, r"isolation: 'none' is not one corral offers"),
        ({"security": {"standard": "privileged"}}, r"security\.standard: 'privileged'"),
        ({"resources": {"max_pids": 1}}, r"resources\.max_pids: 1 is below the minimum"),
        ({"resources": {"memory": 1}}, r"resources\.memory: unknown field"),
        ({"network": {"enabled": "yes"}}, r"network\.enabled: expected true or false"),
        (
            {"network": {"enabled": True, "mode": "none"}},
            r"network\.enabled = true and network\.mode 'none' disagree",
        ),
        (
            {"resources": {"max_pids": 8}, "limits": {"max_pids": 9}},
            r"resources\.max_pids and limits\.max_pids name one setting",
        ),
        ({"isolation": "gvisor", "runtime": "runc"}, r"isolation 'gvisor' and runtime"),
        ({"resources": 5}, r"resources: expected a table"),
    ],
)
def test_refusals_name_the_spec_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Policy.from_dict(config)


def test_policy_files_in_the_spec_shape_are_detected(tmp_path: Path) -> None:
    toml = tmp_path / "spec.toml"
    toml.write_text("enabled = true\n[network]\nenabled = false\n[resources]\nmax_pids = 48\n")
    assert Policy.load(toml).limits.max_pids == 48
    js = tmp_path / "spec.json"
    js.write_text(json.dumps(SPEC_EXAMPLE))
    assert Policy.load(js) == Policy.from_spec_config(SPEC_EXAMPLE)


def test_the_docs_table_and_the_module_table_agree() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "spec-config.md").read_text()
    rows = re.findall(r"^\| `([a-z_.]+)[^|]*\| `?([a-z_.]+)", doc, re.MULTILINE)
    assert len(rows) >= 12
    module_doc = specconfig.__doc__ or ""
    for spec_name, _ in rows:
        assert f"``{spec_name}" in module_doc, spec_name


async def test_a_box_runs_with_the_spec_example(tmp_path: Path) -> None:
    async with Sandbox(Policy.from_spec_config(SPEC_EXAMPLE), workspace=tmp_path) as sb:
        r = await sb.run("echo ok > f && cat f")
        info = await sb.info()
    assert r.stdout == "ok\n", r.stderr
    assert info["max_pids"] == 64
    assert r.timeout == 30
