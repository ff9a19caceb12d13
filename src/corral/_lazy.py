"""PEP 562 lazy attributes for a package's ``__init__``: a public name is imported from its
module on first access, so importing the package costs nothing until a name is used (the
``corral`` command starts without the parts of the library a command does not touch)."""

from __future__ import annotations

TYPE_CHECKING = False  # no typing at run time: the CLI's start pays for every import
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def lazy_getattr(namespace: dict[str, Any], names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the package whose globals are ``namespace``: each name in
    ``names`` (name -> module defining it) is imported on first access and then kept in the
    package's globals, so later accesses are plain attribute reads."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib  # here: `corral run` through a server never takes a lazy name

        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(namespace: dict[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__`` listing the lazy names beside those already loaded."""

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __dir__
