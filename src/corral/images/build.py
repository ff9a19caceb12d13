"""``corral image build``: an image from a small Dockerfile subset, into the image store.

Supported: ``FROM`` (an image ref as :func:`corral.images.resolve_image` takes it, or
``scratch``), ``COPY SRC... DST`` (from the build context; each ``COPY`` is one layer),
``RUN`` (JSON or shell form: a corral box on the image so far, whose writable root's upper
layer becomes the next layer), ``ENV``, ``WORKDIR``, ``USER``, ``CMD``, ``ENTRYPOINT``,
``LABEL`` (ignored), comments and ``\\`` continuations. Anything else is refused with the
line it is on.

``COPY`` never leaves the context: a source with ``..`` or an absolute path is refused, and
symlinks in the context are copied as symlinks, never followed. Files are owned by root
(0:0) in the layer, as Docker does without ``--chown``.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shlex
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral import errors
from corral.images.registry import parse_ref
from corral.images.store import ImageRecord, ImageStore, is_path

if TYPE_CHECKING:
    from corral.images.resolve import BoxUser
    from corral.models import CommandResult
    from corral.policy import Policy

IGNORED = {"LABEL", "MAINTAINER"}
Log = Callable[[str], object]


@dataclass
class Instruction:
    line: int
    op: str
    args: str


@dataclass
class _State:
    base: ImageRecord | None = None
    config: dict[str, Any] = field(default_factory=dict)
    layers: list[Path] = field(default_factory=list)
    policy: Policy | None = None
    """The policy of ``RUN`` boxes (their network, limits, ``filesystem.root_size``)."""
    runs: int = 0
    temp_refs: list[str] = field(default_factory=list)
    """The images ``RUN`` steps ran on (removed once the build is done)."""


def _bad(line: int, message: str) -> errors.ImageError:
    return errors.ImageError(
        f"Dockerfile line {line}: {message}", code=errors.ErrorCode.INVALID_INPUT
    )


def parse(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        op, _, args = whole.partition(" ")
        out.append(Instruction(start, op.upper(), args.strip()))
    if pending:
        raise _bad(start, "the last instruction ends with a continuation")
    return out


def _command(ins: Instruction) -> list[str]:
    if ins.args.startswith("["):
        try:
            value = json.loads(ins.args)
        except ValueError:
            raise _bad(ins.line, f"{ins.op} is not a JSON list of strings") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(ins.line, f"{ins.op} is not a JSON list of strings")
        return value
    return ["/bin/sh", "-c", ins.args]


def _env(ins: Instruction, env: dict[str, str]) -> None:
    words = shlex.split(ins.args)
    if words and "=" not in words[0]:
        key, _, value = ins.args.partition(" ")
        env[key] = value.strip()
        return
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise _bad(ins.line, f"ENV wants KEY=VALUE, got {word!r}")
        env[key] = value


def _copy_layer(ins: Instruction, context: Path, workdir: str, out: Path) -> None:
    words = shlex.split(ins.args)
    if any(w.startswith("--") for w in words):
        raise _bad(ins.line, "COPY options (--from, --chown...) are not supported")
    if len(words) < 2:
        raise _bad(ins.line, "COPY wants SRC... DST")
    *sources, dest = words
    to_dir = dest.endswith("/") or len(sources) > 1
    dest = posixpath.normpath(posixpath.join(workdir, dest)).lstrip("/")
    with tarfile.open(out, "w") as tar:

        def add(path: Path, name: str) -> None:
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)
            # sockets, devices, FIFOs of the context are left out
            if info.isdir():
                for child in sorted(os.listdir(path)):
                    add(path / child, f"{name}/{child}")

        for src in sources:
            parts = src.split("/")
            if src.startswith("/") or ".." in parts:
                raise _bad(ins.line, f"COPY source {src!r} leaves the build context")
            path = context / src
            if not os.path.lexists(path):
                raise _bad(ins.line, f"COPY source {src!r} is not in the build context")
            if path.is_dir() and not path.is_symlink():
                for child in sorted(os.listdir(path)):  # a directory's contents, as docker
                    add(path / child, f"{dest}/{child}")
            else:
                add(path, f"{dest}/{path.name}" if to_dir else dest)


def _config_step(ins: Instruction, config: dict[str, Any]) -> bool:
    """Apply an instruction that only changes the config (or is ignored); False for others."""
    if ins.op == "ENV":
        env = dict(item.partition("=")[::2] for item in config.get("Env") or ())
        _env(ins, env)
        config["Env"] = [f"{k}={v}" for k, v in env.items()]
    elif ins.op == "WORKDIR":
        cwd = str(config.get("WorkingDir") or "/")
        config["WorkingDir"] = posixpath.normpath(posixpath.join(cwd, ins.args))
    elif ins.op == "USER":
        config["User"] = ins.args
    elif ins.op in ("CMD", "ENTRYPOINT"):
        config["Cmd" if ins.op == "CMD" else "Entrypoint"] = _command(ins)
    elif ins.op not in IGNORED:
        return False
    return True


def _run_layer(
    store: ImageStore, state: _State, ins: Instruction, out: Path, log: Log | None
) -> None:
    """``RUN``: the image so far (committed under a temporary ref, removed at the end of
    the build) as a box's writable root; the command runs there as the image's ``USER``
    (root when it names none, as Docker's builds do), in its ``WORKDIR`` (made when
    missing), with its ``Env``, no network and an empty workspace; what it changed becomes
    ``out``, the next layer. A non-zero exit fails the build with the command's output."""
    import asyncio

    from corral.images.resolve import ImageConfig, ResolvedImage, box_user

    state.runs += 1
    temp = f"corral-build.invalid/{os.getpid()}-{id(state):x}:{state.runs}"
    record = store.commit(temp, state.base, state.layers, state.config, source="build-step")
    state.temp_refs.append(temp)
    rootfs = store.rootfs(record)
    config = ImageConfig.from_oci(state.config)
    try:
        user = box_user(ResolvedImage(temp, rootfs, config), None if config.user else "root")
    except errors.PolicyError as exc:
        raise _bad(ins.line, f"RUN: {exc}") from None
    argv = _command(ins)
    cwd = posixpath.normpath(posixpath.join("/", config.workdir or "/"))
    if cwd != "/" and not _is_dir_in(rootfs, cwd):  # Docker makes a missing WORKDIR
        argv = ["/bin/sh", "-c", 'mkdir -p "$1" && cd "$1" && shift && exec "$@"', "sh", cwd]
        argv += _command(ins)
        cwd = "/"
    with store.scratch() as ws:
        result = asyncio.run(
            _run_in_box(state.policy, rootfs, user, argv, cwd, config.env, ws, out)
        )
    if log is not None:
        log(result.stdout + result.stderr)
    if result.exit_code != 0:
        tail = (result.stdout + result.stderr).strip()[-2000:]
        raise _bad(ins.line, f"RUN exited with {result.exit_code}" + (f":\n{tail}" if tail else ""))


async def _run_in_box(
    base: Policy | None,
    rootfs: Path,
    user: BoxUser,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    workspace: Path,
    out: Path,
) -> CommandResult:
    from corral.policy import Policy
    from corral.sandbox import Sandbox

    data = base.model_dump() if base is not None else {}
    policy = Policy.from_dict({**data, "image": str(rootfs), "user": user})
    async with Sandbox(policy, workspace=workspace) as sb:
        result = await sb.run(argv, cwd=cwd, env=env)
        if result.exit_code == 0:
            await sb.export_root(out)
        return result


def _is_dir_in(root: Path, path: str) -> bool:
    from corral.backends.host import safepath

    try:
        fd = safepath.open_beneath(root, path, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def build(
    store: ImageStore,
    dockerfile: str,
    context: Path,
    ref: str,
    *,
    pull: bool = True,
    log: Log | None = None,
    policy: Policy | None = None,
) -> ImageRecord:
    """Build ``dockerfile`` (its text) with ``context`` as the build context, into ``ref``;
    what ``RUN`` commands print goes to ``log``; ``RUN`` boxes start with ``policy`` (default:
    no network, the default limits and ``root_size``), their ``image`` and ``user`` the
    step's. Blocking (``RUN`` starts boxes in an event loop of its own): call it from a
    thread in async code."""
    instructions = parse(dockerfile)
    if not instructions or instructions[0].op != "FROM":
        raise _bad(
            instructions[0].line if instructions else 1, "the first instruction must be FROM"
        )
    state = _State(policy=policy)
    try:
        with store.scratch() as tmp:
            return _steps(store, instructions, context, ref, state, tmp, pull, log)
    finally:
        for temp in state.temp_refs:  # after the commit: the image keeps their roots
            with contextlib.suppress(errors.ImageError):
                store.remove(temp)


def _steps(
    store: ImageStore,
    instructions: list[Instruction],
    context: Path,
    ref: str,
    state: _State,
    tmp: Path,
    pull: bool,
    log: Log | None,
) -> ImageRecord:
    for n, ins in enumerate(instructions):
        if ins.op == "FROM":
            if n:
                raise _bad(ins.line, "one FROM only (no multi-stage builds)")
            if ins.args != "scratch":
                base = store.resolve(ins.args, pull=pull)
                if base is None:
                    kind = "a plain directory" if is_path(ins.args) else "not found"
                    raise _bad(ins.line, f"FROM {ins.args}: {kind}; name an OCI image")
                state.base = base
                state.config = json.loads(json.dumps(base.config))
        elif ins.op == "COPY":
            layer = tmp / f"layer{len(state.layers)}.tar"
            workdir = str(state.config.get("WorkingDir") or "/")
            _copy_layer(ins, context, workdir, layer)
            state.layers.append(layer)
        elif _config_step(ins, state.config):
            continue
        elif ins.op == "RUN":
            layer = tmp / f"layer{len(state.layers)}.tar"
            _run_layer(store, state, ins, layer, log)
            state.layers.append(layer)
        else:
            raise _bad(ins.line, f"{ins.op} is not in corral's Dockerfile subset")
    record = store.commit(str(parse_ref(ref)), state.base, state.layers, state.config)
    workdir = str(state.config.get("WorkingDir") or "/")
    missing = _missing_dirs(store.rootfs(record), workdir)
    if missing:  # Docker makes the WORKDIR: a layer of the directories it lacks
        layer = tmp / f"layer{len(state.layers)}.tar"
        with tarfile.open(layer, "w") as tar:
            for path in missing:
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
        state.layers.append(layer)
        record = store.commit(str(parse_ref(ref)), state.base, state.layers, state.config)
    return record


def _missing_dirs(root: Path, path: str) -> list[str]:
    """The components of ``path`` (absolute) the root lacks, from the first missing one on;
    nothing when it is there, or passes through a link or a file of the image (looked up
    beneath the root without following links: a link is left to the box to follow)."""
    from corral.backends.host import safepath

    parts = [p for p in path.split("/") if p]
    for n in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:n])
        try:
            fd = safepath.open_beneath(root, prefix, os.O_PATH | os.O_NOFOLLOW)
        except FileNotFoundError:
            return ["/" + "/".join(parts[:k]) for k in range(n, len(parts) + 1)]
        except OSError:
            return []
        os.close(fd)
    return []
