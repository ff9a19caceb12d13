"""Policy presets for toolchains that live in the operator's home directory.

The default policy masks ``/root`` and the usual credential directories, so a toolchain
installed there by rustup is invisible in the box. :func:`rust_toolchain` shares exactly
the toolchain (read-only) at the box user's home, where rustup's proxies look by default,
and keeps build output in the workspace::

    policy = rust_toolchain(Policy())
    async with Sandbox(policy, workspace="my-crate") as sb:
        await sb.run(["cargo", "check", "--message-format=json"])

Offline by construction: the box has no network, so crates with registry dependencies need
them vendored (``cargo vendor``) or already in a shared ``CARGO_HOME`` registry cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from corral import errors
from corral.policy import FilesystemPolicy, Mount, Policy

GUEST_HOME = "/home/user"
RUST_PATH = f"{GUEST_HOME}/.cargo/bin:/usr/local/bin:/usr/bin:/bin"


def rust_toolchain(
    base: Policy | None = None,
    *,
    cargo_home: str | os.PathLike[str] = "~/.cargo",
    rustup_home: str | os.PathLike[str] = "~/.rustup",
    target_dir: str = "target",
) -> Policy:
    """``base`` plus the host's rustup toolchain, read-only, and cargo set up to use it.

    Raises:
        PolicyError: ``cargo_home`` or ``rustup_home`` is not a directory.
    """
    base = base or Policy()
    homes = {"cargo": Path(cargo_home).expanduser(), "rustup": Path(rustup_home).expanduser()}
    for what, path in homes.items():
        if not path.is_dir():
            raise errors.PolicyError(f"{what} home {path} is not a directory; is rustup installed?")
    mounts = (
        *base.filesystem.mounts,
        Mount(host=homes["cargo"], guest=f"{GUEST_HOME}/.cargo", mode="ro"),
        Mount(host=homes["rustup"], guest=f"{GUEST_HOME}/.rustup", mode="ro"),
    )
    fs: FilesystemPolicy = base.filesystem.model_copy(update={"mounts": mounts})
    env = {
        "PATH": RUST_PATH,
        "CARGO_HOME": f"{GUEST_HOME}/.cargo",
        "RUSTUP_HOME": f"{GUEST_HOME}/.rustup",
        # CARGO_HOME is read-only here: keep every write (build output) in the workspace.
        "CARGO_TARGET_DIR": f"{base.workdir}/{target_dir}",
        "CARGO_NET_OFFLINE": "true",
        **base.env,
    }
    return base.model_copy(update={"filesystem": fs, "env": env})


PRESETS = {"rust": rust_toolchain}
