"""The spec's ``SandboxConfig`` as an input format: mapped onto the fields of
:class:`corral.Policy` (``Policy.from_spec_config``, and found by itself when a policy file or
mapping uses its shape). Pure mappings: nothing here imports the policy model.

The mapping (docs/spec-config.md has the same table; a test holds the two in step):

- ``enabled = true``: nothing, every box is sandboxed; ``false`` is refused.
- ``isolation`` -> ``backend`` (and ``runtime``): ``namespace`` -> ``bwrap``, ``container``
  -> ``oci``, ``gvisor`` -> ``oci`` + ``runsc``, ``microvm`` -> ``microvm``; ``none`` refused.
- ``filesystem.allow_write``, ``filesystem.deny_write``, ``filesystem.inherit_readable`` ->
  the same fields (a relative path is relative to the workspace).
- ``filesystem.deny_read`` -> ``filesystem.deny_read`` *added to* corral's default list.
- ``network.enabled`` -> ``network.mode``: ``false`` -> ``none``; ``true`` -> ``allowlist``
  when ``allow_hosts`` is given, else ``full``.
- ``network.allowed_domains`` -> ``network.allow_hosts``.
- ``security.standard`` -> ``security.preset``: ``baseline`` (also ``standard``) or
  ``restricted``; ``privileged`` is refused.
- ``resources.memory_bytes``, ``resources.cpu_quota``, ``resources.max_pids``,
  ``resources.exec_timeout_secs`` (any ``resources`` key) -> ``limits.<the same>``.
- ``process_tracking.enabled``, ``process_tracking.max_tracked`` -> the same fields.

corral's own fields (``backend``, ``limits``, ``env``, ``workdir``, ...) may stand beside the
spec's; naming one setting both ways (``resources.max_pids`` and ``limits.max_pids``) is
refused. Enum values are matched without case (``Namespace`` as Rust prints it, or
``namespace``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SPEC_ONLY_KEYS = frozenset({"enabled", "isolation", "resources"})
"""Top-level keys only the spec's shape has: their presence marks a spec config."""

ISOLATION: dict[str, dict[str, str]] = {
    "namespace": {"backend": "bwrap"},
    "bwrap": {"backend": "bwrap"},
    "container": {"backend": "oci"},
    "oci": {"backend": "oci"},
    "gvisor": {"backend": "oci", "runtime": "runsc"},
    "microvm": {"backend": "microvm"},
    "vm": {"backend": "microvm"},
}
SECURITY = {"baseline": "baseline", "standard": "baseline", "restricted": "restricted"}


class SpecConfigError(ValueError):
    """A spec config corral cannot honour; ``Policy`` turns it into a PolicyError."""


def is_spec_config(data: Mapping[str, Any]) -> bool:
    """True when ``data`` uses the spec's ``SandboxConfig`` shape (any of its own keys:
    ``enabled``, ``isolation``, ``resources``, ``network.enabled``, ``security.standard``)."""
    if SPEC_ONLY_KEYS & set(data):
        return True
    network, security = data.get("network"), data.get("security")
    return (isinstance(network, Mapping) and "enabled" in network) or (
        isinstance(security, Mapping) and "standard" in security
    )


def _word(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise SpecConfigError(f"{field}: expected a name, got {value!r}")
    return value.strip().lower().replace("-", "_")


def _table(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecConfigError(f"{key}: expected a table of fields, got {value!r}")
    return dict(value)


def spec_to_policy_dict(
    data: Mapping[str, Any], default_deny_read: tuple[str, ...]
) -> dict[str, Any]:
    """The spec's ``SandboxConfig`` (as a mapping, e.g. loaded from TOML or JSON) -> the
    mapping ``Policy`` validates. ``default_deny_read`` is corral's list the spec's
    ``deny_read`` adds to (a spec config cannot unmask credentials by omission)."""
    out = {k: v for k, v in data.items() if k not in SPEC_ONLY_KEYS}
    enabled = data.get("enabled", True)
    if enabled is not True:
        raise SpecConfigError(
            f"enabled: {enabled!r}: corral always runs commands in a sandbox; remove the key "
            "or set it to true"
        )
    if "isolation" in data:
        out.update(_isolation(data))
    fs = _table(data, "filesystem")
    if "deny_read" in fs:
        extra = fs["deny_read"]
        extra = [extra] if isinstance(extra, str) else list(extra)
        fs["deny_read"] = [*default_deny_read, *(p for p in extra if p not in default_deny_read)]
    if fs:
        out["filesystem"] = fs
    if "network" in data:
        out["network"] = _network(_table(data, "network"))
    if "security" in data:
        out["security"] = _security(_table(data, "security"))
    resources = _table(data, "resources")
    if resources:
        limits = _table(data, "limits")
        both = sorted(set(resources) & set(limits))
        if both:
            raise SpecConfigError(
                f"resources.{both[0]} and limits.{both[0]} name one setting; give one of them"
            )
        out["limits"] = {**limits, **resources}
    return out


def _isolation(data: Mapping[str, Any]) -> dict[str, str]:
    level = _word(data["isolation"], "isolation")
    if level not in ISOLATION:
        raise SpecConfigError(
            f"isolation: {data['isolation']!r} is not one corral offers; use one of "
            f"{', '.join(ISOLATION)}"
        )
    for key, value in ISOLATION[level].items():
        if key in data and _word(data[key], key) != value:
            raise SpecConfigError(f"isolation {level!r} and {key} {data[key]!r} disagree")
    return ISOLATION[level]


def _network(net: dict[str, Any]) -> dict[str, Any]:
    if "allowed_domains" in net:
        if "allow_hosts" in net:
            raise SpecConfigError("network: give allowed_domains or allow_hosts, not both")
        net["allow_hosts"] = net.pop("allowed_domains")
    if "enabled" in net:
        on = net.pop("enabled")
        if not isinstance(on, bool):
            raise SpecConfigError(f"network.enabled: expected true or false, got {on!r}")
        mode = ("allowlist" if net.get("allow_hosts") else "full") if on else "none"
        if "mode" in net and net["mode"] != mode:
            raise SpecConfigError(
                f"network.enabled = {str(on).lower()} and network.mode {net['mode']!r} "
                "disagree; give one of them"
            )
        net["mode"] = mode
    return net


def _security(sec: dict[str, Any]) -> dict[str, Any]:
    if "standard" in sec:
        preset = _word(sec.pop("standard"), "security.standard")
        if preset not in SECURITY:
            raise SpecConfigError(
                f"security.standard: {preset!r} is not a preset corral offers; use baseline "
                "(also called standard) or restricted"
            )
        if "preset" in sec and sec["preset"] != SECURITY[preset]:
            raise SpecConfigError("security.standard and security.preset disagree; give one")
        sec["preset"] = SECURITY[preset]
    return sec


def spec_field(corral_field: str, data: Mapping[str, Any]) -> str:
    """The name the user wrote for ``corral_field`` in the spec config ``data``:
    ``limits.max_pids`` given as ``resources.max_pids`` is reported so."""
    top, _, rest = corral_field.partition(".")
    net, sec = data.get("network"), data.get("security")
    if top == "limits" and rest.split(".")[0] in _table(data, "resources"):
        return "resources." + rest
    if corral_field == "security.preset" and isinstance(sec, Mapping) and "standard" in sec:
        return "security.standard"
    if corral_field == "network.mode" and isinstance(net, Mapping) and "enabled" in net:
        return "network.enabled"
    if corral_field in ("backend", "runtime") and "isolation" in data:
        return "isolation"
    return corral_field
