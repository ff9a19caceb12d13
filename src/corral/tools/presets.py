"""Policy presets for toolchains that live in the operator's home directory.

A box sees the host *system*, not its data: a toolchain installed per user (rustup's
``~/.cargo`` and ``~/.rustup``, nvm's ``~/.nvm``, pyenv's ``~/.pyenv``, the base interpreter
of a venv made with one of those) is invisible in it. A preset shares exactly the toolchain,
read-only, and puts it on ``PATH``::

    policy = rust_toolchain(Policy())
    async with Sandbox(policy, workspace="my-crate") as sb:
        await sb.run(["cargo", "check", "--message-format=json"])

:func:`detect` picks presets from a workspace's files (``Cargo.toml`` -> ``rust``,
``package.json`` -> ``node``, ``pyproject.toml``/``requirements.txt``/... or a venv ->
``python``) when the toolchain is installed in the operator's home; ``corral run`` and
``corral shell`` apply what it finds (``--no-presets`` turns that off, ``--preset`` adds one).

Offline by construction: a box has no network by default, so crates and packages need to be
vendored or already in a cache (or the policy's ``network`` allows the registry).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from corral import errors
from corral.policy import FilesystemPolicy, Mount, Policy

GUEST_HOME = "/home/user"
TOOLCHAINS = "/toolchains"
"""Where home-directory toolchains appear in a box (outside ``HOME``, which stays the box
user's own)."""
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUST_PATH = f"{TOOLCHAINS}/cargo/bin:{SYSTEM_PATH}"
PYTHON_PROJECT_FILES = (
    "pyproject.toml",
    "requirements.txt",
    "setup.py",
    "setup.cfg",
    "Pipfile",
    ".python-version",
)
VENV_NAMES = (".venv", "venv", "env", ".env")
"""Directories of a workspace checked for a virtual environment (``pyvenv.cfg``)."""


def _with(base: Policy, mounts: list[Mount], env: dict[str, str], path: list[str]) -> Policy:
    """``base`` plus read-only ``mounts``, ``env`` and ``path`` entries ahead of its PATH
    (the base's own env wins for every other variable)."""
    fs: FilesystemPolicy = base.filesystem.model_copy(
        update={"mounts": (*base.filesystem.mounts, *mounts)}
    )
    current = base.env.get("PATH", SYSTEM_PATH)
    new_path = ":".join([*(p for p in path if p not in current.split(":")), current])
    merged = {**env, **base.env, "PATH": new_path}
    return base.model_copy(update={"filesystem": fs, "env": merged})


def rust_toolchain(
    base: Policy | None = None,
    *,
    cargo_home: str | os.PathLike[str] = "~/.cargo",
    rustup_home: str | os.PathLike[str] = "~/.rustup",
    target_dir: str = "target",
) -> Policy:
    """``base`` plus the host's rustup toolchain, read-only at ``/toolchains/cargo`` and
    ``/toolchains/rustup``, and cargo set up to use it (build output in the workspace).

    Raises:
        PolicyError: ``cargo_home`` or ``rustup_home`` is not a directory.
    """
    base = base or Policy()
    homes = {"cargo": Path(cargo_home).expanduser(), "rustup": Path(rustup_home).expanduser()}
    for what, path in homes.items():
        if not path.is_dir():
            raise errors.PolicyError(f"{what} home {path} is not a directory; is rustup installed?")
    mounts = [
        Mount(host=homes["cargo"], guest=f"{TOOLCHAINS}/cargo", mode="ro"),
        Mount(host=homes["rustup"], guest=f"{TOOLCHAINS}/rustup", mode="ro"),
    ]
    env = {
        "CARGO_HOME": f"{TOOLCHAINS}/cargo",
        "RUSTUP_HOME": f"{TOOLCHAINS}/rustup",
        # CARGO_HOME is read-only here: keep every write (build output) in the workspace.
        "CARGO_TARGET_DIR": f"{base.workdir}/{target_dir}",
        "CARGO_NET_OFFLINE": "true",
    }
    return _with(base, mounts, env, [f"{TOOLCHAINS}/cargo/bin"])


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name)[:3])


def _home_dir(given: str | os.PathLike[str], default: str, variable: str) -> Path:
    """``given``, or where ``variable`` (NVM_DIR, PYENV_ROOT) puts the default."""
    if str(given) == default and os.environ.get(variable):
        return Path(os.environ[variable])
    return Path(given).expanduser()


def nvm_node(nvm_dir: str | os.PathLike[str] = "~/.nvm") -> Path | None:
    """The node nvm runs by default (its ``alias/default``, else the newest installed)."""
    root = _home_dir(nvm_dir, "~/.nvm", "NVM_DIR")
    versions = root / "versions" / "node"
    try:
        installed = sorted(
            (p for p in versions.iterdir() if (p / "bin" / "node").exists()),
            key=lambda p: _version_key(p.name),
        )
    except OSError:
        return None
    if not installed:
        return None
    try:
        alias = (root / "alias" / "default").read_text().strip().lstrip("v")
    except OSError:
        alias = ""
    if alias and alias[0].isdigit():
        wanted = [p for p in installed if (p.name.lstrip("v") + ".").startswith(alias + ".")]
        if wanted:
            return wanted[-1]
    return installed[-1]


def node_toolchain(
    base: Policy | None = None, *, nvm_dir: str | os.PathLike[str] = "~/.nvm"
) -> Policy:
    """``base`` plus nvm's default node, read-only at ``/toolchains/node``, first on PATH.

    Raises:
        PolicyError: no node installed by nvm under ``nvm_dir``.
    """
    base = base or Policy()
    node = nvm_node(nvm_dir)
    if node is None:
        raise errors.PolicyError(f"no node installed by nvm under {nvm_dir}; is nvm installed?")
    mounts = [Mount(host=node, guest=f"{TOOLCHAINS}/node", mode="ro")]
    return _with(base, mounts, {}, [f"{TOOLCHAINS}/node/bin"])


def _pyenv_root(pyenv_root: str | os.PathLike[str]) -> Path | None:
    root = _home_dir(pyenv_root, "~/.pyenv", "PYENV_ROOT")
    versions = root / "versions"
    return root if versions.is_dir() and any(versions.iterdir()) else None


def hidden_venv_bases(workspace: str | os.PathLike[str], policy: Policy | None = None) -> list[str]:
    """Installations (``<prefix>`` of ``<prefix>/bin/python3``) that a workspace venv's
    interpreter comes from and that a box does not see (a pyenv or a build under a home)."""
    from corral.backends.host.safepath import read_small_beneath
    from corral.backends.layout import on_root

    policy = policy or Policy()
    bases: list[str] = []
    for name in VENV_NAMES:
        # What a box wrote: read as hostile (a regular file, no link followed, 64 KiB at most).
        raw = read_small_beneath(workspace, f"{name}/pyvenv.cfg", 64 << 10)
        if raw is None:
            continue
        text = raw.decode(errors="replace")
        import configparser  # only for a workspace with a venv

        parser = configparser.ConfigParser()
        try:
            parser.read_string("[venv]\n" + text)
        except configparser.Error:
            continue
        home = parser.get("venv", "home", fallback="").strip()
        if not home.startswith("/"):
            continue
        prefix = os.path.dirname(os.path.realpath(home))
        if _python_prefix(prefix) and not on_root(prefix, policy) and prefix not in bases:
            bases.append(prefix)
    return bases


def _python_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is a Python installation (``bin/python3`` a file, the standard
    library's ``lib/python3.X/os.py`` there). The ``home`` a workspace's pyvenv.cfg names is
    the box's to write: shared as it was, any host directory a box named (logs, another
    project, a root-only one) was mounted into the next box of that workspace."""
    import glob

    return os.path.isfile(os.path.join(prefix, "bin", "python3")) and bool(
        glob.glob(os.path.join(glob.escape(prefix), "lib", "python3.*", "os.py"))
    )


def venv_hints(workspace: str | os.PathLike[str], policy: Policy) -> list[str]:
    """A sentence for each workspace venv whose interpreter the box does not see (and no
    mount of ``policy`` shares): it cannot run there, and how to make it."""
    shared = [str(m.host) for m in policy.filesystem.mounts if m.guest == str(m.host)]
    hints = []
    for prefix in hidden_venv_bases(workspace, policy):
        if any(prefix == s or prefix.startswith(s.rstrip("/") + "/") for s in shared):
            continue
        hints.append(
            f"a venv in the workspace runs the interpreter of {prefix}, which the box does "
            "not see (host data): its python fails with 'no such file'. Share it read-only "
            "with the python preset (corral run --preset python; in Python "
            "corral.tools.presets.python_toolchain(policy, workspace=...))"
        )
    return hints


def python_toolchain(
    base: Policy | None = None,
    *,
    pyenv_root: str | os.PathLike[str] = "~/.pyenv",
    workspace: str | os.PathLike[str] | None = None,
) -> Policy:
    """``base`` plus pyenv (read-only at its host path: its scripts name it in their ``#!``
    lines, first on PATH) and, given the ``workspace``, the base installation of each venv
    there whose interpreter the box would not see (a venv made with a host Python under
    ``/root`` or ``/home``), read-only at its own path, so the venv runs as it does on the host.

    Raises:
        PolicyError: neither pyenv nor such a venv is there.
    """
    base = base or Policy()
    mounts: list[Mount] = []
    env: dict[str, str] = {}
    path: list[str] = []
    root = _pyenv_root(pyenv_root)
    if root is not None:
        mounts.append(Mount(host=root, guest=str(root), mode="ro"))
        env["PYENV_ROOT"] = str(root)
        path = [f"{root}/shims", f"{root}/bin"]
    bases = hidden_venv_bases(workspace, base) if workspace is not None else []
    mounts += [
        Mount(host=Path(prefix), guest=prefix, mode="ro")
        for prefix in bases
        if root is None or not (prefix + "/").startswith(str(root) + "/")
    ]
    if not mounts:
        raise errors.PolicyError(
            f"no pyenv under {pyenv_root} and no venv with a hidden interpreter in the workspace"
        )
    return _with(base, mounts, env, path)


PRESETS: dict[str, Callable[[Policy], Policy]] = {
    "rust": rust_toolchain,
    "node": node_toolchain,
    "python": python_toolchain,
}


def detect(workspace: str | os.PathLike[str], policy: Policy | None = None) -> dict[str, str]:
    """The presets a workspace asks for and this host can give, each with why (``{"rust":
    "Cargo.toml, ~/.cargo"}``): the project's files name a toolchain installed in the
    operator's home, or a venv there runs an interpreter the box would not see."""
    ws = Path(workspace)
    found: dict[str, str] = {}
    home = Path("~").expanduser()
    rustup = (home / ".cargo" / "bin" / "cargo").exists() and (home / ".rustup").is_dir()
    if (ws / "Cargo.toml").is_file() and rustup:
        found["rust"] = "Cargo.toml; rustup's ~/.cargo and ~/.rustup"
    if (ws / "package.json").is_file():
        node = nvm_node()
        if node is not None:
            found["node"] = f"package.json; nvm's node {node.name}"
    venvs = hidden_venv_bases(ws, policy)
    project = [f for f in PYTHON_PROJECT_FILES if (ws / f).is_file()]
    if venvs:
        found["python"] = f"a venv whose interpreter lives in {', '.join(venvs)}"
    elif project and _pyenv_root("~/.pyenv") is not None:
        found["python"] = f"{project[0]}; pyenv's ~/.pyenv"
    return found


def apply(
    policy: Policy, names: list[str], workspace: str | os.PathLike[str] | None = None
) -> Policy:
    """``policy`` with each named preset applied (the python preset sees ``workspace``)."""
    for name in dict.fromkeys(names):
        if name == "python":
            policy = python_toolchain(policy, workspace=workspace).derived_from(policy)
        elif name in PRESETS:
            policy = PRESETS[name](policy).derived_from(policy)
        else:
            raise errors.PolicyError(
                f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}"
            )
    return policy
