"""The layout rules of ``corral.backends``, checked on the source (``ast``), not on a list:

1. a backend is a folder of ``corral.backends`` (every package there but ``host``), and the
   registry's backends each live in their own folder;
2. a backend folder never imports a sibling backend folder;
3. the shared model (``corral.backends`` itself, ``base``, ``layout``, ``users``, ``limits``,
   ``host/``) imports no backend folder: adding a backend is adding a folder;
4. outside ``corral.backends`` only the doctor (which reports on each backend's host
   requirements) imports a backend folder: ``sandbox``, ``pool`` and the rest go through the
   registry and the protocol in ``base``;
5. ``sandbox`` and ``pool`` use only public names of other modules: they import no
   ``_name``, read or call no ``obj._name`` that their own module does not define, and do
   no duck typing (``getattr``/``hasattr``/``setattr``) on what a backend returns.

Every import statement counts, also under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import corral
from corral import backends

SRC = Path(corral.__file__).resolve().parent
BACKENDS = SRC / "backends"
SHARED_PACKAGES = {"host"}
"""Packages of corral.backends that are the shared model's, not backends."""
MAY_IMPORT_BACKENDS = {"corral.doctor", "corral.cli.doctor"}
"""Outside corral.backends, the host report of ``corral doctor`` (either home of it)."""
PUBLIC_PROTOCOL_USERS = ("corral.sandbox", "corral.pool")
# The guest agent's process handle is fed by the sandbox that owns its channel: these hooks
# are Process's side of that pairing (corral.processes), not a backend's internals.
PROCESS_HOOKS = {"_lost", "_on_output", "_on_exit"}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def modules() -> Iterator[Module]:
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield Module(".".join(parts), path, ast.parse(path.read_text(), str(path)))


def imports(module: Module) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, imported module, names)`` of every import statement, relative ones
    resolved. ``from a import b`` yields ``a`` and ``a.b`` (b may be a module)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [a.name for a in node.names]
            yield node.lineno, base, names
            for name in names:
                yield node.lineno, f"{base}.{name}", []


def backend_folders() -> set[str]:
    return {
        p.parent.name
        for p in BACKENDS.glob("*/__init__.py")
        if p.parent.name not in SHARED_PACKAGES
    }


def folder_of(module_name: str) -> str | None:
    """The backend folder a module belongs to, or None (shared model or outside)."""
    parts = module_name.split(".")
    if parts[:2] != ["corral", "backends"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in backend_folders() else None


def test_every_registered_backend_is_a_folder_of_its_own() -> None:
    folders = backend_folders()
    assert {"bwrap", "oci", "microvm"} <= folders
    for name, (module_name, _) in backends._BACKENDS.items():
        folder = folder_of(module_name)
        assert folder is not None, f"{name} is registered as {module_name}, not in a folder"
        assert (BACKENDS / folder / "box.py").is_file()


def test_a_backend_folder_never_imports_a_sibling_backend() -> None:
    bad = []
    for module in modules():
        own = folder_of(module.name)
        if own is None:
            continue
        for line, target, _ in imports(module):
            other = folder_of(target)
            if other is not None and other != own:
                bad.append(f"{module.path.relative_to(SRC)}:{line} imports {target}")
    assert bad == []


def test_the_shared_model_imports_no_backend() -> None:
    bad = []
    for module in modules():
        if not module.name.startswith("corral.backends") or folder_of(module.name):
            continue
        for line, target, _ in imports(module):
            if folder_of(target) is not None:
                bad.append(f"{module.path.relative_to(SRC)}:{line} imports {target}")
    assert bad == []


def test_outside_the_backends_only_the_doctor_imports_a_backend() -> None:
    bad = []
    for module in modules():
        if module.name.startswith("corral.backends") or module.name in MAY_IMPORT_BACKENDS:
            continue
        for line, target, _ in imports(module):
            if folder_of(target) is not None:
                bad.append(f"{module.path.relative_to(SRC)}:{line} imports {target}")
    assert bad == []


def _defined_privates(tree: ast.Module) -> set[str]:
    """``_names`` a module defines: functions, classes, assignments, ``self._x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_sandbox_and_pool_use_only_public_names_and_the_box_protocol() -> None:
    bad = []
    by_name = {m.name: m for m in modules()}
    for name in PUBLIC_PROTOCOL_USERS:
        module = by_name[name]
        own = _defined_privates(module.tree)
        where = module.path.relative_to(SRC)
        for line, target, names in imports(module):
            if target.startswith("corral"):
                bad += [f"{where}:{line} imports {n} from {target}" for n in names if _private(n)]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                receiver = node.value
                if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                    continue
                if node.attr in own or node.attr in PROCESS_HOOKS:
                    continue
                bad.append(f"{where}:{node.lineno} reaches into .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
            ):
                bad.append(f"{where}:{node.lineno} duck-types with {node.func.id}()")
    assert bad == []


def test_the_box_protocol_is_complete_for_what_the_sandbox_calls() -> None:
    """Every attribute the sandbox uses on its box is a member of ``base.Box``."""
    protocol = {
        n
        for n, v in vars(backends.base.Box).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    by_name = {m.name: m for m in modules()}
    used = set()
    for node in ast.walk(by_name["corral.sandbox"].tree):
        # self._box.<member> and box.<member> where box = self._box (the heartbeat)
        if isinstance(node, ast.Attribute):
            receiver = node.value
            if (isinstance(receiver, ast.Attribute) and receiver.attr == "_box") or (
                isinstance(receiver, ast.Name) and receiver.id == "box"
            ):
                used.add(node.attr)
    assert used, "the sandbox no longer calls its box through self._box: update this test"
    assert used <= protocol, used - protocol
