"""The guest agent's own Python inside the microVM's initramfs.

Started from the host's root over 9p, the agent's interpreter spent about 1.5 s of a VM's
boot (software emulation) reading itself and its modules through a cold 9p cache. Instead the
initramfs carries the host's interpreter, the shared libraries it links and the standard
library modules the agent imports, so the agent starts before the snapshot point with every
import done, and a restored VM goes straight to its mounts. After them the agent moves itself
into the box's root (``switch_root`` done in-process); anything it imports later comes from
the host's own standard library there, the same version as the one packed here.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from corral.backends.base import AGENT_DIR

_LIST_FILES = """
import importlib, importlib.util, json, os, sys
sys.path.insert(0, sys.argv[1])
import vminit
for name in vminit.VM_PRELOAD:
    importlib.import_module(name)
files = set()
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if not path or os.path.dirname(os.path.abspath(path)) == os.path.abspath(sys.argv[1]):
        continue
    files.add(os.path.abspath(path))
    if path.endswith(".py"):
        cached = importlib.util.cache_from_source(path)
        if os.path.exists(cached):
            files.add(cached)
dynload = [p for p in sys.path if p.endswith("lib-dynload")]
print(json.dumps({"files": sorted(files), "dynload": dynload, "executable": sys.executable}))
"""

_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


class RuntimeNotPackable(Exception):
    """The interpreter or its libraries could not be listed (the message says why)."""


def runtime_files(python: str) -> tuple[list[Path], list[Path]]:
    """``(files, directories)`` to copy, at the same absolute paths, so that ``python`` runs
    in the initramfs and imports everything in the agent's ``vminit.VM_PRELOAD``."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", _LIST_FILES, str(AGENT_DIR)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        listed = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise RuntimeNotPackable(f"could not list {python}'s modules: {exc}") from None
    files = [Path(python).resolve(), *map(Path, listed["files"])]
    binaries = [files[0], *(p for p in files if p.suffix == ".so")]
    files += shared_libraries(binaries)
    dirs = [Path(d) for d in listed["dynload"]]  # must exist, or python warns at start
    return sorted(set(files)), dirs


def shared_libraries(binaries: list[Path]) -> list[Path]:
    """The libraries (and the dynamic loader) ``ldd`` lists for ``binaries``."""
    found: set[Path] = set()
    for binary in binaries:
        try:
            out = subprocess.run(
                ["ldd", str(binary)], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeNotPackable(f"ldd {binary} failed: {exc}") from None
        for line in out.splitlines():
            match = _LDD_LINE.search(line)
            if match:
                found.add(Path(match.group(1)))
    return sorted(found)
