"""No import cycles in corral: dependencies point one way (see DESIGN.md).

The graph is read from the source with ``ast``, not from ``sys.modules``, so an import hidden
in a function body counts as much as one at the top of a module. The rule:

* every ``import a.b`` and ``from a.b import c`` anywhere in a module (top level, function
  bodies, ``try`` blocks...) is an edge to the corral module it names: ``a.b.c`` when that is a
  module or package, else ``a.b``; relative imports are resolved against the package;
* ``importlib.import_module("a.b")`` and ``__import__("a.b")`` with a literal name count too;
* importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but that is not an edge:
  a package's ``__init__`` is an edge only when it is imported by name (``from a import X``
  where ``X`` is not a submodule);
* imports under ``if TYPE_CHECKING:`` are left out of the runtime graph (they never run) but
  kept in the typing graph, which must be acyclic as well: a cycle that only the type checker
  sees is still two modules that each need the other.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
Graph = dict[str, set[str]]


def _modules(src: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The package's modules one module imports, by the rule in the module docstring."""

    def __init__(
        self, module: str, is_package: bool, modules: set[str], type_checking: bool
    ) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.type_checking = type_checking
        self.edges: set[str] = set()

    def _add(self, name: str) -> None:
        while name and name not in self.modules:  # `import a.b.attr` or a foreign module
            name = name.rpartition(".")[0]
        if name:
            self.edges.add(name)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node) and not self.type_checking:
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(first.value)
        self.generic_visit(node)


def import_graph(src: Path, package: str = "corral", *, type_checking: bool = False) -> Graph:
    """``module -> modules of the package it imports``, by the rule in the module docstring."""
    modules = _modules(src, package)
    graph: Graph = {}
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py", set(modules), type_checking)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[module] = visitor.edges - {module}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _cycle_path(graph: Graph, component: list[str]) -> str:
    """One concrete loop through a component, for the failure message."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    node = start
    while True:
        nxt = sorted(graph[node] & members)
        if start in nxt and len(path) > 1:
            return " -> ".join([*path, start])
        unseen = [n for n in nxt if n not in seen]
        if not unseen:
            return " <-> ".join(component)
        node = unseen[0]
        path.append(node)
        seen.add(node)


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "typing"])
def test_corral_has_no_import_cycles(type_checking: bool) -> None:
    graph = import_graph(SRC, type_checking=type_checking)
    assert len(graph) > 50  # the walk really read the package
    found = [_cycle_path(graph, c) for c in cycles(graph)]
    assert found == [], "import cycles (break them; dependencies point one way):\n" + "\n".join(
        found
    )


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_walk_sees_imports_hidden_in_functions_and_strings(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from pkg import b\n",
            "pkg/b.py": "import importlib\nimportlib.import_module('pkg.c')\n",
            "pkg/c.py": "from . import a\n",
            "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_graph(src, "pkg", type_checking=True)["pkg.d"] == {"pkg.a"}


def test_a_package_init_is_an_edge_only_when_its_names_are_imported(tmp_path: Path) -> None:
    src = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub.x import X\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/x.py": "X = 1\n",
            "pkg/sub/y.py": "from pkg.sub import x\nfrom pkg import X\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert graph["pkg.sub.x"] == set()  # running pkg/__init__ on the way is not an edge
    assert graph["pkg.sub.y"] == {"pkg.sub.x", "pkg"}
    assert graph["pkg"] == {"pkg.sub.x"}
    assert cycles(graph) == []
