"""What ``corral run`` leaves out of its own process (it runs one box and exits).

Two imports that the libraries below corral make for features this process never uses cost
about 15% of a ``corral run -- true`` (valgrind instruction counts; bench/bench_cli_start.py):

- pydantic loads its plugins when it builds its first validator: ``importlib.metadata`` (with
  email, zipfile, csv, ...) and a scan of every installed distribution's entry points, ~70 M
  instructions. ``PYDANTIC_DISABLE_PLUGINS`` skips the scan but not that import. The command
  validates only its own policy, so it runs pydantic without plugins.
- asyncio imports ``ssl`` (OpenSSL's shared libraries and their set-up, ~57 M instructions)
  for TLS transports, which corral never asks asyncio for (nothing in corral opens a TLS
  connection through the event loop; image pulls are skopeo's). asyncio is imported here with
  ssl out of reach, so its TLS transports say "ssl module not available"; ``import ssl``
  itself works as before afterwards.

Both are no-ops in a process that has already imported pydantic or asyncio (tests, a library
user calling :func:`corral.cli.main`): nothing already loaded is changed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable

__all__ = ["lean_imports"]

_PLUGIN_LOADER = "pydantic.plugin._loader"


def _no_plugins() -> Iterable[object]:
    return ()


def _without_pydantic_plugins() -> None:
    if "pydantic" in sys.modules or _PLUGIN_LOADER in sys.modules:
        return
    # pydantic imports its loader only inside create_schema_validator, and calls only this.
    loader = types.ModuleType(_PLUGIN_LOADER, "pydantic plugins: none in `corral run`")
    loader.get_plugins = _no_plugins  # type: ignore[attr-defined]
    sys.modules[_PLUGIN_LOADER] = loader


def _asyncio_without_ssl() -> None:
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return
    sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` -> ImportError
    try:
        import asyncio  # noqa: F401
    finally:
        if sys.modules.get("ssl", 0) is None:
            del sys.modules["ssl"]


def lean_imports() -> None:
    """Before the first import of pydantic and asyncio: leave out their plugin loader and
    ssl (see the module's docstring)."""
    _without_pydantic_plugins()
    _asyncio_without_ssl()
