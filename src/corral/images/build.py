"""``corral image build``: an image from a small Dockerfile subset, into the image store.

Supported: ``FROM`` (an image ref as :func:`corral.images.resolve_image` takes it, or
``scratch``), ``COPY SRC... DST`` (from the build context; each ``COPY`` is one layer),
``ENV``, ``WORKDIR``, ``USER``, ``CMD``, ``ENTRYPOINT`` (JSON or shell form), ``LABEL``
(ignored), comments and ``\\`` continuations. Anything else, ``RUN`` included, is refused with
the line it is on: ``RUN`` needs a box running on the image being built (a writable root whose
upper layer becomes the next layer), which is the part of the images work that runs boxes.

``COPY`` never leaves the context: a source with ``..`` or an absolute path is refused, and
symlinks in the context are copied as symlinks, never followed. Files are owned by root
(0:0) in the layer, as Docker does without ``--chown``.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral import errors
from corral.images.registry import parse_ref
from corral.images.store import ImageRecord, ImageStore, is_path

IGNORED = {"LABEL", "MAINTAINER"}


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


def build(
    store: ImageStore, dockerfile: str, context: Path, ref: str, *, pull: bool = True
) -> ImageRecord:
    """Build ``dockerfile`` (its text) with ``context`` as the build context, into ``ref``."""
    instructions = parse(dockerfile)
    if not instructions or instructions[0].op != "FROM":
        raise _bad(
            instructions[0].line if instructions else 1, "the first instruction must be FROM"
        )
    state = _State()
    with store.scratch() as tmp:
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
            elif ins.op == "ENV":
                env = dict(item.partition("=")[::2] for item in state.config.get("Env") or ())
                _env(ins, env)
                state.config["Env"] = [f"{k}={v}" for k, v in env.items()]
            elif ins.op == "WORKDIR":
                cwd = str(state.config.get("WorkingDir") or "/")
                state.config["WorkingDir"] = posixpath.normpath(posixpath.join(cwd, ins.args))
            elif ins.op == "USER":
                state.config["User"] = ins.args
            elif ins.op in ("CMD", "ENTRYPOINT"):
                state.config["Cmd" if ins.op == "CMD" else "Entrypoint"] = _command(ins)
            elif ins.op in IGNORED:
                continue
            elif ins.op == "RUN":
                raise _bad(
                    ins.line,
                    "RUN is not supported yet: it needs a box on the image being built; "
                    "build the root another way (mmdebstrap, a registry image) and COPY onto it",
                )
            else:
                raise _bad(ins.line, f"{ins.op} is not in corral's Dockerfile subset")
        return store.commit(str(parse_ref(ref)), state.base, state.layers, state.config)
