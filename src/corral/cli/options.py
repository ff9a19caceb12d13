"""Options every sandbox-starting command shares, and the policy they build."""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import sys
from pathlib import Path
from typing import TextIO

from corral import errors
from corral.net.cli import apply_network_options
from corral.policy import Limits, Policy
from corral.tools import presets
from corral.tools.presets import PRESETS

__all__ = [
    "EXIT_SANDBOX",
    "EXIT_USAGE",
    "add_raw_option",
    "add_sandbox_options",
    "build_policy",
    "checked_workspace",
    "terminal_safe",
    "with_presets",
    "workspace_danger",
]

EXIT_USAGE = 2
EXIT_SANDBOX = 125


def add_raw_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--raw",
        action="store_true",
        help="print box output as is, escape sequences included, even to a terminal "
        "(output to a pipe or file is always as is)",
    )


def terminal_safe(text: str, stream: TextIO, args: argparse.Namespace) -> str:
    """``text`` for ``stream``: as is to a pipe or file (or with ``--raw``); to a terminal,
    without the escape sequences a box could use against it (OSC 52, titles, ...)."""
    if getattr(args, "raw", False) or not stream.isatty():
        return text
    from corral.output import for_terminal

    return for_terminal(text)


def build_policy(args: argparse.Namespace) -> Policy:
    """Policy file first, then the command-line overrides on top."""
    trust = bool(getattr(args, "trust_writable_policy", False))
    loaded = Policy.load(args.policy, trust_writable=trust) if args.policy else Policy()
    policy = _with_backend(loaded, getattr(args, "backend", None), getattr(args, "runtime", None))
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
    return apply_network_options(policy, args).derived_from(loaded)


def with_presets(policy: Policy, args: argparse.Namespace, workspace: str) -> Policy:
    """``policy`` with the ``--preset`` toolchains and those the workspace asks for
    (:func:`corral.tools.presets.detect`; each said on stderr), unless ``--no-presets``."""
    names = list(getattr(args, "preset", None) or [])
    if not getattr(args, "no_presets", False):
        for name, why in presets.detect(workspace, policy).items():
            if name not in names:
                names.append(name)
                print(
                    f"corral: preset {name} ({why}), shared read-only; --no-presets turns this off",
                    file=sys.stderr,
                )
    return presets.apply(policy, names, workspace)


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
        "--trust-writable-policy",
        action="store_true",
        help="take a --policy file that lies where the box can write (you review it each run)",
    )
    p.add_argument(
        "--backend",
        choices=["bwrap", "bwrap-rootless", "oci", "microvm"],
        help="isolation backend (default: bwrap; rootless when not root)",
    )
    p.add_argument(
        "--runtime",
        choices=["runc", "crun", "runsc"],
        help="OCI runtime of --backend oci (default: the first that works here)",
    )
    p.add_argument(
        "--workspace", metavar="DIR", default=".", help="host dir mounted read-write (default: .)"
    )
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=sorted(PRESETS),
        help="share a toolchain from your home read-only (rust: ~/.cargo and ~/.rustup, node: "
        "nvm's default node, python: pyenv and the interpreter of a workspace venv)",
    )
    p.add_argument(
        "--no-presets",
        action="store_true",
        help="apply no preset the workspace's files ask for (Cargo.toml, package.json, ...)",
    )
    p.add_argument(
        "--force-workspace",
        action="store_true",
        help="accept /, a system directory or a home directory as the workspace",
    )


# The host's system trees: neither they nor anything inside them is a workspace.
_SYSTEM_TREES = (
    "/etc",
    "/usr",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/var/lib",
    "/var/log",
    "/var/cache",
    "/var/spool",
    "/var/backups",
    "/var/mail",
)
# Directories that hold other people's data: refused themselves, their subdirectories are fine.
_SYSTEM_DIRS = ("/var", "/run", "/srv", "/opt", "/tmp", "/mnt", "/media", "/home", "/root")


def _homes() -> set[str]:
    homes = {os.path.realpath(os.path.expanduser("~")), "/root"}
    with contextlib.suppress(OSError):
        for entry in pwd.getpwall():
            if entry.pw_dir.startswith("/home/") or entry.pw_uid >= 1000:
                homes.add(os.path.realpath(entry.pw_dir))
    homes.update(str(p) for p in Path("/home").glob("*") if p.is_dir())
    return {h for h in homes if h not in ("/", "/nonexistent")}


def workspace_danger(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` must not be a box's writable workspace (None: it may be). The box may
    create, change and delete anything there."""
    real = os.path.realpath(path)
    if real == "/":
        return "it is the host's root directory"
    for tree in _SYSTEM_TREES:
        if real == tree or real.startswith(tree + "/"):
            return f"it is a system directory ({tree})"
    if real in _SYSTEM_DIRS and real not in ("/root", "/home"):
        return f"it is a system directory ({real})"
    for home in _homes():
        if real == home:
            return "it is a home directory (keys, tokens and shell startup files live there)"
        if home.startswith(real + "/"):
            return f"it holds a home directory ({home})"
    return None


def checked_workspace(args: argparse.Namespace) -> str:
    """The workspace of ``--workspace`` (default: the current directory), refused when it
    is /, a system directory or a home directory unless ``--force-workspace``."""
    workspace = str(args.workspace)
    why = workspace_danger(workspace)
    if why is not None and not getattr(args, "force_workspace", False):
        shown = os.path.realpath(workspace)
        default = " (the current directory)" if workspace == "." else ""
        raise errors.SandboxError(
            f"refusing {shown}{default} as the workspace: {why}, and the box could change "
            "anything in it. cd to a project directory or give --workspace DIR; to share it "
            "anyway, add --force-workspace",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return workspace
