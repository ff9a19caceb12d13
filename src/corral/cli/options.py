"""Options every sandbox-starting command shares, and the policy they build."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn, TextIO

from corral import errors
from corral.workspaces import refuse_dangerous_workspace, workspace_danger

if TYPE_CHECKING:
    from collections.abc import Callable

    from corral.policy import Policy

__all__ = [
    "EXIT_SANDBOX",
    "EXIT_USAGE",
    "Parser",
    "UsageError",
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


class UsageError(Exception):
    """A bad command line: reported on one line (or as JSON), exit 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


PRESET_NAMES = ("node", "python", "rust")
"""The names of :data:`corral.tools.presets.PRESETS` (a test keeps them equal), for
``--preset``'s choices without importing the policy models to build a parser."""


def add_raw_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--raw",
        action="store_true",
        help="print box output as is, escape sequences included, even to a terminal "
        "(output to a pipe or file is always as is)",
    )


def terminal_safe(text: str, stream: TextIO, args: argparse.Namespace | None) -> str:
    """``text`` for ``stream``: as is to a pipe or file (or with ``--raw``); to a terminal,
    without the escape sequences a box could use against it (OSC 52, titles, ...)."""
    if getattr(args, "raw", False) or not stream.isatty():
        return text
    from corral.output import for_terminal

    return for_terminal(text)


def build_policy(args: argparse.Namespace) -> Policy:
    """Policy file first, then the command-line overrides on top."""
    from corral.net.cli import apply_network_options
    from corral.policy import Limits, Policy

    trust = bool(getattr(args, "trust_writable_policy", False))
    loaded = Policy.load(args.policy, trust_writable=trust) if args.policy else Policy()
    policy = _with_backend(loaded, getattr(args, "backend", None), getattr(args, "runtime", None))
    if getattr(args, "image", None):
        policy = Policy.from_dict({**policy.model_dump(), "image": args.image})
    if getattr(args, "user", None):
        policy = Policy.from_dict({**policy.model_dump(), "user": args.user})
    limits: dict[str, object] = {}
    if getattr(args, "memory", None):
        limits["memory_bytes"] = args.memory
    if getattr(args, "cpus", None):
        limits["cpu_quota"] = args.cpus
    if getattr(args, "pids", None):
        limits["max_pids"] = args.pids
    if limits:
        merged = {**policy.limits.model_dump(), **limits}
        new_limits = Limits(**merged)  # a PolicyError in corral's words naming the field
        policy = policy.model_copy(update={"limits": new_limits})
    return apply_network_options(policy, args).derived_from(loaded)


def with_presets(
    policy: Policy,
    args: argparse.Namespace,
    workspace: str,
    say: Callable[[str], object] | None = None,
) -> Policy:
    """``policy`` with the ``--preset`` toolchains and those the workspace asks for
    (:func:`corral.tools.presets.detect`; each said on stderr, or to ``say``: ``corral
    serve`` sends the line to the CLI that asked, not into its own log), unless
    ``--no-presets``."""
    from corral.tools import presets

    names = list(getattr(args, "preset", None) or [])
    if not getattr(args, "no_presets", False):
        for name, why in presets.detect(workspace, policy).items():
            if name not in names:
                names.append(name)
                line = (
                    f"corral: preset {name} ({why}), shared read-only; --no-presets turns this off"
                )
                if say is None:
                    print(line, file=sys.stderr)
                else:
                    say(line)
    return presets.apply(policy, names, workspace)


def _with_backend(policy: Policy, backend: str | None, runtime: str | None) -> Policy:
    """``--backend``/``--runtime`` over the policy file; ``--runtime`` alone implies oci."""
    if backend is None and runtime is None:
        return policy
    if runtime is not None and backend not in (None, "oci"):
        raise errors.PolicyError(f"--runtime {runtime} needs --backend oci, not {backend}")
    from corral.policy import Policy

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
        "--image",
        metavar="REF",
        help="the box's root: an image (a root directory, an OCI layout or archive, a registry "
        "ref; see `corral image`) instead of the host's system (bwrap backend, as root)",
    )
    p.add_argument(
        "--user",
        choices=("user", "root"),
        help="who commands run as: the box user (uid 1000) or box root (an unprivileged host "
        "uid; bwrap backend, as root); default: the image's User, else user",
    )
    p.add_argument(
        "--workspace", metavar="DIR", default=".", help="host dir mounted read-write (default: .)"
    )
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=PRESET_NAMES,
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


def checked_workspace(args: argparse.Namespace) -> str:
    """The workspace of ``--workspace`` (default: the current directory), refused when it
    is /, a system directory or a home directory unless ``--force-workspace``."""
    workspace = str(args.workspace)
    if not getattr(args, "force_workspace", False):
        default = " (the current directory)" if workspace == "." else ""
        refuse_dangerous_workspace(
            workspace,
            fix="cd to a project directory or give --workspace DIR; to share it anyway, add "
            "--force-workspace",
            shown_as=default,
        )
    return workspace
