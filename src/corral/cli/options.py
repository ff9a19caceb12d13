"""Options every sandbox-starting command shares, and the policy they build."""

from __future__ import annotations

import argparse

from corral import errors
from corral.net.cli import apply_network_options
from corral.policy import Limits, Policy

__all__ = ["EXIT_SANDBOX", "EXIT_USAGE", "add_sandbox_options", "build_policy"]

EXIT_USAGE = 2
EXIT_SANDBOX = 125


def build_policy(args: argparse.Namespace) -> Policy:
    """Policy file first, then the command-line overrides on top."""
    policy = Policy.load(args.policy) if args.policy else Policy()
    policy = _with_backend(policy, getattr(args, "backend", None), getattr(args, "runtime", None))
    limits: dict[str, object] = {}
    if getattr(args, "memory", None):
        limits["memory_bytes"] = args.memory
    if getattr(args, "cpus", None):
        limits["cpu_quota"] = args.cpus
    if getattr(args, "pids", None):
        limits["max_pids"] = args.pids
    if limits:
        merged = {**policy.limits.model_dump(), **limits}
        try:
            new_limits = Limits.model_validate(merged)
        except ValueError as exc:
            raise errors.PolicyError(f"invalid limit: {exc}") from None
        policy = policy.model_copy(update={"limits": new_limits})
    return apply_network_options(policy, args)


def _with_backend(policy: Policy, backend: str | None, runtime: str | None) -> Policy:
    """``--backend``/``--runtime`` over the policy file; ``--runtime`` alone implies oci."""
    if backend is None and runtime is None:
        return policy
    if runtime is not None and backend not in (None, "oci"):
        raise errors.PolicyError(f"--runtime {runtime} needs --backend oci, not {backend}")
    data = policy.model_dump()
    data["backend"] = backend or ("oci" if runtime else policy.backend)
    data["runtime"] = runtime or (policy.runtime if data["backend"] == "oci" else None)
    return Policy.from_dict(data)


def add_sandbox_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", metavar="FILE", help="TOML policy file (see README)")
    p.add_argument(
        "--backend", choices=["bwrap", "oci", "microvm"], help="isolation backend (default: bwrap)"
    )
    p.add_argument(
        "--runtime",
        choices=["runc", "crun", "runsc"],
        help="OCI runtime of --backend oci (default: the first that works here)",
    )
    p.add_argument(
        "--workspace", metavar="DIR", default=".", help="host dir mounted read-write (default: .)"
    )
