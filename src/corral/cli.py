"""The ``corral`` command: ``run``, ``doctor`` and the interactive and server commands.

Every command maps corral errors to a one-line message and a non-zero exit (no traceback):
2 for bad input, 125 when the sandbox itself failed (like ``docker run``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence

from corral import errors
from corral.net.cli import add_network_options, apply_network_options
from corral.policy import Limits, Policy, parse_size

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


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert isinstance(value, int)
    return value


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


def cmd_run(args: argparse.Namespace) -> int:
    from corral.sandbox import Sandbox

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("corral run: give a command after --, e.g. corral run -- make test", file=sys.stderr)
        return EXIT_USAGE
    policy = build_policy(args)

    async def go() -> int:
        async with Sandbox(policy, workspace=args.workspace) as sb:
            for warning in sb.warnings:
                print(f"corral: warning: {warning}", file=sys.stderr)
            result = await sb.run(command, timeout=args.timeout, stdin=_stdin_data(args))
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            if result.timed_out:
                print(f"corral: timed out after {args.timeout:g} s", file=sys.stderr)
            if result.oom_killed:
                print("corral: the memory limit killed a process (--memory)", file=sys.stderr)
        if result.timed_out:
            return 124
        return result.exit_code if result.exit_code >= 0 else 128 - result.exit_code

    return asyncio.run(go())


def _stdin_data(args: argparse.Namespace) -> bytes | None:
    if args.stdin:
        return sys.stdin.buffer.read()
    return None


def cmd_doctor(args: argparse.Namespace) -> int:
    from corral.doctor import run_checks

    checks = run_checks()
    if args.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("warn" if not c.required else "FAIL")
            print(f"[{mark}] {c.name}: {c.detail}")
            if not c.ok and c.fix:
                print(f"       fix: {c.fix}")
    return 0 if all(c.ok for c in checks if c.required) else 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corral", description="Run commands and code inside Linux sandboxes."
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run one command in a fresh sandbox")
    add_sandbox_options(run)
    run.add_argument("--memory", type=_size, metavar="SIZE", help="memory cap, e.g. 512M")
    run.add_argument("--cpus", type=float, metavar="N", help="CPU cap in cores, e.g. 1.5")
    run.add_argument("--pids", type=int, metavar="N", help="max processes in the box")
    run.add_argument("--timeout", type=float, metavar="SECS", help="kill the command after SECS")
    add_network_options(run)
    run.add_argument("--json", action="store_true", help="print one JSON object with the result")
    run.add_argument("--stdin", action="store_true", help="pass corral's stdin to the command")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=cmd_run)

    doctor = sub.add_parser("doctor", help="check what this host supports and how to fix it")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=cmd_doctor)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[
    Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]
]:
    """Subcommands that live beside their feature (interactive sessions, MCP server)."""
    found = []
    for module, name in (
        ("corral.cli_interactive", "register"),
        ("corral.cli_mcp", "add_mcp_command"),
        ("corral.cli_audit", "register"),
    ):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if fn is not None:
            found.append(fn)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except errors.PolicyError as exc:
        print(f"corral: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except errors.SandboxError as exc:
        print(f"corral: [{exc.code}] {exc.message}", file=sys.stderr)
        return EXIT_USAGE if exc.code == errors.ErrorCode.INVALID_INPUT else EXIT_SANDBOX
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
