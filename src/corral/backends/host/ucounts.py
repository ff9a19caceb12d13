"""Kernel quotas charged to a user namespace's owner rather than to a cgroup.

inotify instances and watches and POSIX message queue bytes are counted per (user namespace,
uid) and again, up the chain of namespaces, per host uid that *owns* each namespace (the
euid of the process that created it). The host-level counts are checked against the host's
sysctls (``fs.inotify.max_user_instances``, ``fs.inotify.max_user_watches``) and the
creator's ``RLIMIT_MSGQUEUE``. When every box's namespace had the same owner (bwrap ran as
one uid; OCI runtimes create namespaces as host root), one box filling its inotify instances
locked every other box out, and on OCI host root itself.

So every box gets its own owner: :func:`claim_owner` hands out a host uid from
:data:`~corral.backends.users.OWNER_UID_BASE` onwards, unique among the boxes running on
this host (a lock file per uid, held while the box lives), and the backend creates the
box's user namespace as that uid (bwrap runs as it; OCI runtimes join a namespace corral
created as it). Each box is then held by the host's per-user limits alone, and host root's
own budget is untouched.

``RLIMIT_MSGQUEUE``: the box's own namespace counts its commands against the agent's
:data:`corral.agent.commands.BOX_MSGQUEUE_BYTES`; the host level checks the limit the
namespace's creator had, which corral lifts once (:func:`lift_msgqueue_limit`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.backends.host.state import state_root
from corral.backends.layout import SYSTEM_PATH
from corral.backends.users import OWNER_SLOTS, OWNER_UID_BASE, command_id
from corral.errors import BackendError


def lift_msgqueue_limit() -> None:
    """Make ``RLIMIT_MSGQUEUE`` unlimited for this process and the box creators it starts
    (needs CAP_SYS_RESOURCE: the backends that call it run as root)."""
    unlimited = resource.RLIM_INFINITY
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (unlimited, unlimited))


@dataclass
class BoxOwner:
    """The host uid that owns one box's user namespace, held until :meth:`release`."""

    uid: int
    fd: int = -1
    """The slot's lock file (flock'd; closed by :meth:`release` or this process's death)."""

    @property
    def command_id(self) -> int:
        """The host uid and gid of the box's commands (box uid 1000), from the same slot."""
        return command_id(self.uid)

    def release(self) -> None:
        """Free the uid for another box (once nothing of this box runs any more)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def claim_owner() -> BoxOwner:
    """A namespace owner uid no other running box on this host holds (BackendError when all
    :data:`OWNER_SLOTS` are taken): the lowest free one, so the ids a host uses stay few and
    what is made per id (an idmapped mount's namespace, :mod:`.idmap`) is made again rarely."""
    folder = state_root() / "owners"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    for slot in range(OWNER_SLOTS):
        fd = os.open(folder / str(slot), flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return BoxOwner(OWNER_UID_BASE + slot, fd)
    raise BackendError(
        f"all {OWNER_SLOTS} namespace owner ids are held by running boxes; close some boxes"
    )


def make_userns(owner: int, uid_map: str, gid_map: str) -> int:
    """A new user namespace owned by host uid ``owner``, with these id maps: an fd of it
    (the caller closes it; the namespace lives while the fd or a process in it does).

    For OCI runtimes, which run as host root and would make every box's namespace host
    root's: they join this one by path. ``unshare --user`` runs as ``owner`` and execs
    ``cat``, which echoes a byte once the namespace exists; the maps are written from here
    (host root), then ``cat`` sees end of input and exits. Blocking (a few ms)."""
    setpriv, unshare, cat = (
        shutil.which(p, path=SYSTEM_PATH) for p in ("setpriv", "unshare", "cat")
    )
    if not (setpriv and unshare and cat):
        raise BackendError("setpriv and unshare (util-linux) are needed to make a box's namespace")
    ids = (f"--reuid={owner}", f"--regid={owner}", "--clear-groups")
    proc = subprocess.Popen(
        [setpriv, *ids, "--", unshare, "--user", "--", cat],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"x")
        proc.stdin.flush()
        if proc.stdout.read(1) != b"x":
            raise BackendError("could not create the box's user namespace (unshare --user)")
        Path(f"/proc/{proc.pid}/uid_map").write_text(uid_map)
        Path(f"/proc/{proc.pid}/gid_map").write_text(gid_map)
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        proc.stdin.close()
        proc.stdout.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
