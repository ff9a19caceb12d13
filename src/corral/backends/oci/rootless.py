"""The OCI backend for an ordinary user (rootless): runc and crun when corral is not root.

Each runtime call runs in a user namespace of the user's own making, as podman's rootless
mode runs its runtime (``podman unshare``): ``unshare --user --mount`` with the ids below
mapped, the runtime then root in it. Run by the user directly, neither runtime works here:

- runc chowns its exec fifo and the box's stdio to the host id of box root, which a user may
  do only when box root is the user itself (then commands could not be an id of their own);
- crun refuses this host's hybrid cgroup layout whatever its cgroup manager, and the user
  cannot unmount the cgroup2 mount in a namespace of its own (a mount copied from a more
  privileged namespace is locked to what it covers): it is covered by an empty read-only
  tmpfs there, so crun sees a v1 host, and ``--cgroup-manager=disabled`` makes no cgroup.

Ids, the same host ids as a rootless bwrap box (:func:`corral.backends.users.rootless_ranges`):

    subordinate ids   outer namespace  0 -> the user, 1..65535 -> the subordinate range
                      box              0 -> outer 1, 1000 -> outer 0, 1001.. -> outer 1001..
                      so the agent is the range's first id, commands are the user (what they
                      write in the workspace is the user's), other box ids the range's
    none              outer namespace  0 -> the user; box 0 -> outer 0: commands run as box
                      root with no capability (the bundle keeps none), as on bwrap

The runtime's process ends when the box runs (``run --detach``), so nothing stays in the
outer namespace but the box, in a user namespace below it. A later call (``delete``) gets
another outer namespace, which has no power over the box's processes: corral kills the box's
init itself first, from the host, where the user owns every namespace down to the box's.

Limits: the runtime makes no cgroup (it may not). Where the user has a delegated cgroup v2
subtree (:func:`corral.backends.host.cgroups.rootless_limits`), corral makes the box's group
there and moves the box's init into it once the runtime is gone, as for rootless bwrap;
what no controller enforces is the planner's ``rlimits`` fallback, each a warning.

runsc is refused: its rootless mode runs without the user namespace corral's guarantees
rest on.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from corral.backends.host import subids
from corral.backends.layout import SYSTEM_PATH
from corral.backends.users import rootless_ranges
from corral.errors import BackendUnavailable

OUTER_IDS = subids.NEEDED_IDS - 1
"""Subordinate ids mapped into the outer namespace (outer 1..65535): every box id but 1000."""
KILL_WAIT = 5.0
"""Seconds to wait for a killed box's init to be gone before its runtime state is deleted."""


@dataclass(frozen=True, slots=True)
class RootlessMode:
    """How a rootless runtime is called and what its boxes are told."""

    outer: tuple[str, ...]
    """The command prefix that puts the runtime in its own user (and mount) namespace."""
    mapped: bool
    """Subordinate ids: commands run as a box id of their own (not the agent's)."""
    warning: str | None
    """The weaker separation without subordinate ids, and its fix (a warning of each box)."""

    @property
    def box_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """The box's ``(box id, outer id, count)`` maps, for uids and gids alike."""
        return tuple(rootless_ranges(0, 1 if self.mapped else None))

    @property
    def facts(self) -> dict[str, str]:
        """``info()["rootless"]``: the same keys as a rootless bwrap box's."""
        return {"ids": "subordinate" if self.mapped else "single", "limits": "rlimits"}


def outer_argv(unshare: str, probe: subids.RootlessProbe, cover: str | None) -> tuple[str, ...]:
    """``unshare`` options for the runtime's outer namespace, then (``cover``: crun on a
    hybrid cgroup host) a shell that covers that mount point before it execs the runtime."""
    argv = [unshare, "--user", "--mount"]
    ids = probe.subids
    if probe.mapped and ids.uid_start is not None and ids.gid_start is not None:
        argv += [
            "--map-user=0",
            "--map-group=0",
            f"--map-users={ids.uid_start},1,{OUTER_IDS}",
            f"--map-groups={ids.gid_start},1,{OUTER_IDS}",
        ]
    else:
        argv.append("--map-root-user")
    argv.append("--")
    if cover is not None:
        script = 'mount -t tmpfs -o ro,size=4k corral "$0" && exec "$@"'
        argv += ["/bin/sh", "-c", script, cover]
    return tuple(argv)


def rootless_mode(runtime: str, cover: str | None) -> RootlessMode:
    """How ``runtime`` runs boxes for this user, or BackendUnavailable naming the fix."""
    if runtime == "runsc":
        raise BackendUnavailable(
            "runsc (gVisor) does not run boxes for an ordinary user here: its rootless mode "
            "has no user namespace and no seccomp of corral's; use runtime 'crun' or 'runc' "
            "(or the bwrap backend), or run corral as root for gVisor"
        )
    problem = subids.userns_problem()
    if problem is not None:
        raise BackendUnavailable(f"rootless {runtime}: {problem}")
    unshare = shutil.which("unshare", path=SYSTEM_PATH)
    if unshare is None:
        raise BackendUnavailable(
            f"rootless {runtime} needs unshare (util-linux); as root run once: "
            "apt-get install util-linux"
        )
    probe = subids.probe()
    warning = None
    if not probe.mapped:
        warning = subids.SINGLE_ID_WARNING.format(why=probe.separation_problem)
    return RootlessMode(outer_argv(unshare, probe, cover), probe.mapped, warning)


def kill_init(state_dir: Path, box_id: str) -> None:
    """SIGKILL the box's init (pid 1 of its pid namespace: the kernel ends the rest), found
    in ``init.pid`` and checked to be this box's agent (the pid may have been reused), and
    wait until it is gone. Blocking."""
    try:
        pid = int((state_dir / "init.pid").read_text())
        fd = os.pidfd_open(pid)
    except (OSError, ValueError):
        return
    try:
        with contextlib.suppress(OSError):
            if box_id.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return  # another process now: the box is gone already
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], KILL_WAIT)  # readable once it has exited
    finally:
        os.close(fd)
