from __future__ import annotations

from pathlib import Path

import pytest

from corral import Policy, PolicyError
from corral.errors import ErrorCode
from corral.policy import DEFAULT_DENY_READ, parse_size


def test_defaults_protect_secrets_and_have_no_network() -> None:
    p = Policy()
    assert p.network.mode == "none"
    assert "~/.ssh" in p.filesystem.deny_read
    assert "/etc/shadow" in p.filesystem.deny_read
    assert p.filesystem.inherit_readable is True
    assert p.limits.memory_bytes == 1 << 30
    assert p.security.preset == "baseline"


@pytest.mark.parametrize(
    ("text", "value"),
    [("512M", 512 << 20), ("2G", 2 << 30), ("64KiB", 64 << 10), ("100", 100), (7, 7)],
)
def test_sizes_accept_suffixes(text: object, value: int) -> None:
    assert parse_size(text) == value


def test_size_in_policy_dict_is_parsed() -> None:
    p = Policy.from_dict({"limits": {"memory_bytes": "256M", "output_bytes": "64K"}})
    assert p.limits.memory_bytes == 256 << 20
    assert p.limits.output_bytes == 64 << 10


def test_unknown_field_is_named_in_the_error() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"limits": {"memroy_bytes": 5}})
    assert info.value.code == ErrorCode.INVALID_POLICY
    assert "limits.memroy_bytes" in info.value.message
    assert "unknown field" in info.value.message


def test_bad_enum_lists_allowed_values() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"security": {"preset": "paranoid"}})
    assert "security.preset" in info.value.message
    assert "'baseline'" in info.value.message and "'restricted'" in info.value.message


def test_restricted_refuses_extra_writable_paths() -> None:
    with pytest.raises(PolicyError, match="restricted"):
        Policy.from_dict(
            {"security": {"preset": "restricted"}, "filesystem": {"allow_write": ["/srv"]}}
        )


def test_policy_is_frozen() -> None:
    p = Policy()
    with pytest.raises(ValueError, match="frozen"):
        p.workdir = "/elsewhere"  # type: ignore[misc]


def test_loads_toml_file(tmp_path: Path) -> None:
    f = tmp_path / "corral.toml"
    f.write_text(
        'workdir = "/work"\n'
        '[limits]\nmemory_bytes = "128M"\nmax_pids = 32\n'
        '[filesystem]\ndeny_write = [".git"]\n'
        '[[filesystem.mounts]]\nhost = "/usr/share"\nguest = "/data"\n'
        '[env]\nFOO = "bar"\n'
    )
    p = Policy.load(f)
    assert p.workdir == "/work"
    assert p.limits.max_pids == 32
    assert p.filesystem.mounts[0].guest == "/data"
    assert p.filesystem.mounts[0].mode == "ro"
    assert p.env == {"FOO": "bar"}
    assert p.filesystem.deny_read == DEFAULT_DENY_READ


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("limits = [")
    with pytest.raises(PolicyError, match=r"bad\.toml"):
        Policy.load(f)


def test_missing_policy_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="not found"):
        Policy.load(tmp_path / "nope.toml")


def test_relative_mount_guest_path_is_refused() -> None:
    with pytest.raises(PolicyError, match="absolute"):
        Policy.from_dict({"filesystem": {"mounts": [{"host": "/usr", "guest": "usr"}]}})


def test_network_and_backend_fields_parse() -> None:
    p = Policy.from_dict(
        {
            "backend": "oci",
            "runtime": "runc",
            "network": {"mode": "allowlist", "allow_hosts": ["*.example.com", "pypi.org:443"]},
            "vm": {"cpus": 2, "memory_mb": 256},
        }
    )
    assert p.network.allow_hosts == ("*.example.com", "pypi.org:443")
    assert (p.runtime, p.vm.cpus, p.vm.memory_mb) == ("runc", 2, 256)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"runtime": "runc"}, "needs backend 'oci'"),
        ({"security": {"preset": "restricted"}, "network": {"mode": "full"}}, "no network"),
        ({"network": {"mode": "open"}}, "network.mode"),
        ({"network": {"ports": [70000]}}, "network.ports"),
        ({"backend": "docker"}, "backend"),
    ],
)
def test_bad_backend_and_network_fields_are_named(data: dict[str, object], needle: str) -> None:
    with pytest.raises(PolicyError, match=needle):
        Policy.from_dict(data)


@pytest.mark.parametrize("env", [{"A=B": "1"}, {"X": "a\0b"}, {"": "1"}, {"N\0": "1"}])
def test_an_environment_the_kernel_cannot_take_is_refused_naming_env(env: dict[str, str]) -> None:
    """As ``run(env=...)`` refuses it: the start failed on one as a retryable
    ``backend_failed`` (a bare ValueError), and an empty name was dropped in silence."""
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"env": env})
    assert info.value.code == ErrorCode.INVALID_POLICY
    assert info.value.message.startswith("invalid policy: env: ")
    assert Policy.from_dict({"env": {"NAME": "a=b c"}}).env == {"NAME": "a=b c"}
