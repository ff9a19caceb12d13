"""A workspace with a size and inode cap (``filesystem.workspace_size``/``workspace_inodes``).

A box's writes land in its workspace, a host directory that outlives it, so without a cap a
box can fill the host's disk (``limits.rlimits.fsize`` caps one file, not their number) or
its inodes. Linux caps a directory tree only with project quotas, which need a filesystem
mounted with ``prjquota`` and a kernel built with ``CONFIG_QUOTA``; corral does not set them
(the kernel this was built on has no quota support at all). What corral does:

* a **temporary** workspace (a sandbox started without ``workspace=``) with a cap is a
  tmpfs of that ``size``/``nr_inodes``, mounted ``nosuid,nodev`` on a staging directory
  under the state root (so the orphan sweep unmounts it if the owner dies), removed at
  close; its pages are charged to the box's memory cgroup as it writes them;
* a **host directory** given as the workspace with a cap is refused with a PolicyError that
  says so, rather than started without the cap.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from corral import errors
from corral.backends.host import mounts, staging
from corral.policy import Policy

_MS_NOSUID_NODEV = mounts.MS_NOSUID | mounts.MS_NODEV


def asked(policy: Policy) -> bool:
    fs = policy.filesystem
    return fs.workspace_size is not None or fs.workspace_inodes is not None


def refuse_for_host_dir(policy: Policy, workspace: Path) -> None:
    """A PolicyError when a cap is asked for a host directory (nothing here enforces it)."""
    if not asked(policy):
        return
    field = "workspace_size" if policy.filesystem.workspace_size is not None else "workspace_inodes"
    raise errors.PolicyError(
        f"filesystem.{field}: the workspace {workspace} is a host directory, which corral "
        "cannot cap (that needs project quotas, which corral does not set); drop the cap, or "
        "start the sandbox without workspace= to get a temporary workspace with it"
    )


def make_workspace(policy: Policy, name: str) -> Path:
    """A temporary workspace: a tmpfs with the policy's caps. Blocking (a mount)."""
    fs = policy.filesystem
    options = ["mode=0700"]
    if fs.workspace_size is not None:
        options.append(f"size={fs.workspace_size}")
    if fs.workspace_inodes is not None:
        options.append(f"nr_inodes={fs.workspace_inodes}")
    entry = staging.new_entry("mnt", f"{name}.quota")
    target = entry / "ws"
    done = mounts.libc().mount(
        b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID_NODEV, ",".join(options).encode()
    )
    if done != 0:
        err = ctypes.get_errno()
        staging.release_staging(entry)
        raise errors.BackendError(
            f"cannot make a capped workspace (mount tmpfs: {os.strerror(err)}); corral needs "
            "root on the host for filesystem.workspace_size/workspace_inodes"
        )
    return target


def release_workspace(workspace: Path) -> None:
    """Unmount and remove a workspace of :func:`make_workspace` (its contents go with it)."""
    staging.release_staging(workspace.parent)
