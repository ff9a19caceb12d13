"""The public API is locked: ``corral.__all__`` and the signatures of the public classes are
compared with ``tests/public_api.txt``.

A change there is a change for every user, so it must be deliberate: regenerate the file with
``CORRAL_UPDATE_API=1 pytest tests/test_public_api.py`` and commit it with the change (the
diff then shows up in review).
"""

from __future__ import annotations

import difflib
import enum
import inspect
import os
import re
from pathlib import Path
from typing import Any

import pydantic

import corral
from corral.files import Files
from corral.sessions.batch import BatchResult, StepResult
from corral.sessions.expect import Case, Match
from corral.sessions.pty import PtySession
from corral.streaming import ExecStream, Exited, PendingExecStream, Stderr, Stdout
from corral.sync import SyncFiles, SyncProcess
from corral.tools import Toolbox

SNAPSHOT = Path(__file__).with_name("public_api.txt")

# Public classes reachable from corral's API that are not in corral.__all__ (return types).
RETURNED: list[type] = [
    PtySession,
    Case,
    Match,
    BatchResult,
    StepResult,
    PendingExecStream,
    ExecStream,
    Stdout,
    Stderr,
    Exited,
    Files,
    SyncProcess,
    SyncFiles,
    Toolbox,
]
DUNDERS = {
    "__init__",
    "__call__",
    "__aenter__",
    "__aexit__",
    "__enter__",
    "__exit__",
    "__aiter__",
    "__anext__",
    "__await__",
    "__iter__",
    "__len__",
}


def _annotation(value: Any) -> str:
    text = value if isinstance(value, str) else inspect.formatannotation(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # functions in Annotated metadata


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, shown_star = [], False
    for param in sig.parameters.values():
        if param.kind is param.KEYWORD_ONLY and not shown_star:
            parts.append("*")
            shown_star = True
        text = param.name
        if param.kind is param.VAR_POSITIONAL:
            text, shown_star = "*" + text, True
        elif param.kind is param.VAR_KEYWORD:
            text = "**" + text
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {param.default!r}"
        parts.append(text)
        if param.kind is param.POSITIONAL_ONLY and (
            param is list(sig.parameters.values())[-1]
            or next(iter(list(sig.parameters.values())[len(parts) :]), param).kind
            is not param.POSITIONAL_ONLY
        ):
            parts.append("/")
    returns = ""
    if sig.return_annotation is not sig.empty:
        returns = f" -> {_annotation(sig.return_annotation)}"
    return f"({', '.join(parts)}){returns}"


def _members(cls: type) -> list[str]:
    """Members the class defines, or inherits from a private corral base (``_Model``)."""
    lines: list[str] = []
    seen: set[str] = set()
    for owner in cls.__mro__:
        if owner is not cls and not (
            owner.__module__.startswith("corral") and owner.__name__.startswith("_")
        ):
            continue
        for name, value in vars(owner).items():
            if name in seen or (name.startswith("_") and name not in DUNDERS):
                continue
            if name.startswith("model_") and issubclass(cls, pydantic.BaseModel):
                continue
            seen.add(name)
            lines.append(_member(cls, name, value))
    return sorted(line for line in lines if line)


def _member(cls: type, name: str, value: Any) -> str:
    if isinstance(value, property):
        returns = inspect.signature(value.fget).return_annotation if value.fget else None
        setter = " (settable)" if value.fset is not None else ""
        return f"property {name} -> {_annotation(returns)}{setter}"
    if isinstance(value, staticmethod | classmethod):
        kind = "staticmethod" if isinstance(value, staticmethod) else "classmethod"
        return f"{kind} {name}{_signature(getattr(cls, name))}"
    if inspect.iscoroutinefunction(value):
        return f"async {name}{_signature(value)}"
    if inspect.isfunction(value):
        return f"def {name}{_signature(value)}"
    if isinstance(value, int | float | str | bool | tuple | frozenset):
        return f"{name} = {value!r}"
    return ""  # slots, descriptors of dataclass fields (in the signature), nested helpers


def describe_class(cls: type) -> list[str]:
    bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__ if b is not object)
    lines = [f"class {cls.__module__}.{cls.__qualname__}" + (f"({bases})" if bases else "")]
    if issubclass(cls, enum.Enum):
        lines += [f"  {m.name} = {m.value!r}" for m in cls]
        return lines
    if issubclass(cls, pydantic.BaseModel):
        for name, field in cls.model_fields.items():
            default = field.get_default(call_default_factory=True)
            shown = "" if field.is_required() else f" = {default!r}"
            lines.append(f"  field {name}: {_annotation(field.annotation)}{shown}")
    lines += [f"  {line}" for line in _members(cls)]
    return lines


def public_api() -> str:
    lines = ["corral.__all__ = ["]
    lines += [f"    {name}," for name in corral.__all__]
    lines.append("]")
    exported = [getattr(corral, name) for name in corral.__all__]
    classes = [obj for obj in exported if isinstance(obj, type)] + RETURNED
    for cls in classes:
        lines.append("")
        lines += describe_class(cls)
    return "\n".join(lines) + "\n"


def test_the_public_api_matches_the_snapshot() -> None:
    current = public_api()
    if os.environ.get("CORRAL_UPDATE_API"):
        SNAPSHOT.write_text(current)
    expected = SNAPSHOT.read_text()
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            current.splitlines(keepends=True),
            "tests/public_api.txt",
            "the code",
        )
    )
    assert not diff, (
        "the public API changed. If that is deliberate, regenerate the snapshot with "
        "CORRAL_UPDATE_API=1 pytest tests/test_public_api.py and commit it:\n" + diff
    )


def test_every_name_in_all_exists_and_is_listed_once() -> None:
    assert len(set(corral.__all__)) == len(corral.__all__)
    assert sorted(corral.__all__) == list(corral.__all__)
    for name in corral.__all__:
        assert getattr(corral, name) is not None


def _params(fn: Any) -> list[tuple[str, Any, Any, Any]]:
    sig = inspect.signature(fn)
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in sig.parameters.values()
        if p.name != "self"
    ]


def test_the_sync_facade_takes_exactly_the_async_arguments() -> None:
    # No **kwargs that would lose the types: same names, kinds, defaults and annotations.
    for name in ("run", "spawn"):
        assert _params(getattr(corral.SyncSandbox, name)) == _params(getattr(corral.Sandbox, name))
    # The pool's one-shot takes a workspace, then exactly Sandbox.run's arguments.
    pool_run = _params(corral.SandboxPool.run)
    assert pool_run[1][0] == "workspace"
    assert [pool_run[0], *pool_run[2:]] == _params(corral.Sandbox.run)
    init = _params(corral.SyncSandbox.__init__)
    assert init == [p for p in _params(corral.Sandbox.__init__) if p[0] != "backend"]
