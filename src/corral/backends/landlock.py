"""The Landlock rules of a box (``Policy`` -> guest paths), from the same layout the backends
mount (:mod:`corral.backends.layout`): pure, so the rules are unit-tested.

The guest agent applies them to itself before it serves any request
(:mod:`corral.agent.landlock`), so every command inherits them. They repeat the layout's
read-only / writable / absent split in the kernel's own terms: a mount the layout did not
mean (a bwrap or runtime misconfiguration, a bind left behind) is still denied.

- read and execute: the host system view (or the minimal root), the agent's directory, the
  interpreter's installation, read-only ``mounts``, the network's files, /run, /sys;
- everything: the workspace, ``allow_write``, rw ``mounts``, /tmp, /home, /dev;
- read and write files (no execute, nothing created): the box's own /proc;
- the names in / (listing it), nothing else there.

Masks (``deny_read``, ``deny_write``) stay the mounts' job: Landlock only adds rights down a
tree, so it cannot take write back below a writable directory.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from corral.backends.host.python import HOST_PREFIX
from corral.backends.layout import (
    GUEST_AGENT_DIR,
    MERGED_USR_LINKS,
    MINIMAL_RO_DIRS,
    MINIMAL_RO_FILES,
    SYSTEM_TOP,
    VAR_SYSTEM,
    expand,
)
from corral.policy import Policy

MQUEUE = "/dev/mqueue"
"""The box's mqueue mount: ``mq_open`` reaches queues through its IPC namespace's internal
mount, whose root is this mount's root, so the rule must name it (``/dev`` does not cover
it)."""
OFF_BY_POLICY = "turned off by the policy (security.landlock = false)"


def rules(
    policy: Policy,
    python: str,
    extra: Iterable[str] = (),
    home: str | None = None,
    *,
    deferred: bool = False,
    image_top: Sequence[str] | None = None,
    image_writable: bool = False,
) -> dict[str, Any]:
    """The agent's ``landlock`` config: guest paths by kind (``read``, ``write``, ``proc``),
    or ``{"off": why}``. ``extra``: further read-only guest paths (the network's binds).

    ``deferred`` (a warm pool's box, whose workspace is mounted over its staging directory
    when claimed): the agent applies the rules at the first request that needs them, not at
    start. A rule names an inode, and Landlock skips a mount point hidden by a later mount,
    so a rule made on the staging directory would not reach the workspace mounted on it.

    ``image_top`` (a box on an image root): the image's top-level directories are what is
    read, and the agent's interpreter is the host's, under :data:`HOST_PREFIX`;
    ``image_writable`` (its overlay root): they are written too."""
    if not policy.security.landlock:
        return {"off": OFF_BY_POLICY}
    fs = policy.filesystem
    home = home if home is not None else str(Path.home())
    if image_top is not None:
        read = list(image_top)
    elif fs.inherit_readable:
        read = ["/" + name for name in sorted(SYSTEM_TOP)] + list(VAR_SYSTEM)
    else:
        read = [*MERGED_USR_LINKS, *MINIMAL_RO_DIRS, *MINIMAL_RO_FILES, "/etc/passwd", "/etc/group"]
    prefix = str(Path(python).resolve().parent.parent)  # the interpreter's installation
    if image_top is not None:
        prefix = HOST_PREFIX + prefix
    read += [prefix, GUEST_AGENT_DIR, "/run", "/sys", *extra]
    read += [m.guest for m in fs.mounts if m.mode != "rw"]
    write = [policy.workdir, "/tmp", "/home", "/dev", MQUEUE]
    write += [expand(raw, home) for raw in fs.allow_write]
    write += [m.guest for m in fs.mounts if m.mode == "rw"]
    if image_top is not None and image_writable:
        write.append("/")  # the overlay is the box's root: its mounts hold the rest
    return {
        **({"deferred": True} if deferred else {}),
        "read": ["/", *dict.fromkeys(read)],
        "write": list(dict.fromkeys(write)),
        "proc": ["/proc"],
    }


def host_abi() -> tuple[int, str]:
    """(Landlock ABI version, "") of this kernel, or (0, why not): what a bwrap or runc box
    gets (a microVM's own kernel and gVisor's are their own)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = int(libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))
    if abi >= 1:
        return abi, ""
    err = ctypes.get_errno()
    if err == errno.EOPNOTSUPP:
        return 0, "built into the kernel but not enabled: boot with lsm=...,landlock"
    return 0, "this kernel has no Landlock (5.13+ built with CONFIG_SECURITY_LANDLOCK)"
