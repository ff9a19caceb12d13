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

A slot's lock is held by the host process that started the box, so a host process killed
hard (SIGKILL mid-start or mid-run) frees the slot while what ran as its uids may live on
(pasta, a runtime's box, a process its cleanup missed). Before the next box takes the slot,
:func:`sweep_free_slots` (run with every orphan sweep) kills every process still running as
the owner uid or the command uid of a slot nobody holds.

``RLIMIT_MSGQUEUE``: the box's own namespace counts its commands against the agent's
:data:`corral.agent.commands.BOX_MSGQUEUE_BYTES`; the host level checks the limit the
namespace's creator had, which corral lifts once (:func:`lift_msgqueue_limit`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.backends.host import dropids
from corral.backends.layout import SYSTEM_PATH
from corral.backends.users import (
    COMMAND_UID_BASE,
    ID_RANGE,
    OWNER_SLOTS,
    OWNER_UID_BASE,
    ROOT_BOX_ID_BASE,
    command_id,
)
from corral.errors import BackendError

OWNERS_DIR = Path("/run/corral/owners")
"""The slots' lock files, one per slot: host-wide whatever ``CORRAL_STATE_DIR`` says, since
the uids they hand out are host-wide (two state directories must not hand out one uid)."""

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


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
    def slot(self) -> int:
        """The slot's number: the lowest free one when it was claimed, so ``slot`` other
        boxes were running then."""
        return self.uid - OWNER_UID_BASE

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


def _try_slot(folder: Path, slot: int) -> int:
    """The slot's lock file, flock'd by this call, or -1 when someone holds it."""
    fd = os.open(folder / str(slot), _FLAGS, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim_owner(folder: Path = OWNERS_DIR) -> BoxOwner:
    """A namespace owner uid no other running box on this host holds (BackendError when all
    :data:`OWNER_SLOTS` are taken): the lowest free one, so the ids a host uses stay few and
    what is made per id (an idmapped mount's namespace, :mod:`.idmap`) is made again rarely."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for slot in range(OWNER_SLOTS):
        fd = _try_slot(folder, slot)
        if fd >= 0:
            return BoxOwner(OWNER_UID_BASE + slot, fd)
    raise BackendError(
        f"all {OWNER_SLOTS} namespace owner ids are held by running boxes; close some boxes"
    )


def slot_of(uid: int) -> int | None:
    """The slot whose owner uid or command uid ``uid`` is, or whose block of ids (a box
    whose commands are box root: :func:`corral.backends.users.own_block`) holds it; else
    None. The other box ids of every other box share one range (``HOST_UID_BASE``) that no
    process of theirs can take: commands run as uid 1000 without capabilities, and only
    box-root commands (whose ids are their slot's block) may change uid."""
    for base in (OWNER_UID_BASE, COMMAND_UID_BASE):
        if base <= uid < base + OWNER_SLOTS:
            return uid - base
    if ROOT_BOX_ID_BASE <= uid < ROOT_BOX_ID_BASE + OWNER_SLOTS * ID_RANGE:
        return (uid - ROOT_BOX_ID_BASE) // ID_RANGE
    return None


def slot_processes() -> dict[int, set[int]]:
    """slot -> pids of the live (not zombie) processes that have one of the slot's uids
    (:func:`slot_of`) as their real, effective, saved or filesystem uid. One read of
    ``/proc/PID/status`` per process."""
    return {slot: set(pids) for slot, pids in _slot_scan().items()}


def _slot_scan() -> dict[int, dict[int, set[int]]]:
    """slot -> pid -> the slot's uids that process has."""
    found: dict[int, dict[int, set[int]]] = {}
    for pid, uids, state in _processes():
        if state == "Z":
            continue
        for uid in uids:
            slot = slot_of(uid)
            if slot is not None:
                found.setdefault(slot, {}).setdefault(pid, set()).add(uid)
    return found


def _processes() -> Iterator[tuple[int, tuple[int, ...], str]]:
    """(pid, uids, state letter) of every process, read from its status file."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read(2048)
        except OSError:
            continue  # gone meanwhile
        uids: tuple[int, ...] = ()
        state = ""
        for line in status.split(b"\n"):
            if line.startswith(b"State:"):
                state = line[6:].strip()[:1].decode()
            elif line.startswith(b"Uid:"):
                uids = tuple(int(u) for u in line[4:].split())
                break
        yield int(name), uids, state


SWEEP_WAIT = 5.0
"""Seconds the sweep waits for a free slot's killed processes to be gone."""


def sweep_free_slots(folder: Path = OWNERS_DIR) -> list[int]:
    """Kill every process still running as the owner or command uid of a slot nobody holds
    (its host process died without ending it), and wait until they are gone; the slots
    swept. Each slot is locked meanwhile, so no box claims it before its last process is
    gone. Blocking (one pass over ``/proc``; more only where something is left)."""
    swept: list[int] = []
    if os.geteuid() != 0:
        return swept  # slots are root's (rootless boxes take none) and so are their uids
    leftovers = _slot_scan()
    if not leftovers:
        return swept
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for slot, found in sorted(leftovers.items()):
        fd = _try_slot(folder, slot)
        if fd < 0:
            continue  # a running box's: its host process lives
        try:
            _kill_slot(slot, found)
        finally:
            os.close(fd)
        swept.append(slot)
    return swept


def _kill_slot(slot: int, found: dict[int, set[int]]) -> None:
    """SIGKILL everything running as the slot's two uids (and the ids of its block that
    ``found``, pid -> uids, shows in use) and wait for it to end.

    ``kill(-1, SIGKILL)`` run as each uid reaches every process of that uid in one pass
    under the kernel's task list lock, so a process forking meanwhile cannot slip past
    (a kill of pid after pid could miss the children). A pidfd per process seen tells
    when it is gone; a second pass catches what was between two uids."""
    uids = {OWNER_UID_BASE + slot, COMMAND_UID_BASE + slot}
    uids |= {uid for held in found.values() for uid in held}
    pids = set(found)
    for _ in range(3):
        pidfds = []
        for pid in pids:
            with contextlib.suppress(OSError):
                pidfds.append(os.pidfd_open(pid))
        try:
            for uid in sorted(uids):  # with the ids of its block that processes had
                _kill_all_of(uid)
            _wait_gone(pidfds, SWEEP_WAIT)
        finally:
            for fd in pidfds:
                os.close(fd)
        found = _slot_scan().get(slot, {})
        if not found:
            return
        pids = set(found)
        uids |= {uid for held in found.values() for uid in held}


def _kill_all_of(uid: int) -> None:
    """``kill(-1, SIGKILL)`` as ``uid`` (no groups): every process that uid may signal,
    which is every process running as it, in any namespace. The host's interpreter runs it
    (neither procps' ``kill`` nor dash's builtin take pid -1 with a named signal here)."""
    python = shutil.which("python3", path=SYSTEM_PATH)
    if python is None:
        return
    drop = dropids.as_uid(uid)  # exec'd, so this large process is vforked, not forked
    ids: dict[str, Any] = {} if drop else {"user": uid, "group": uid, "extra_groups": []}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            [*(drop or ()), python, "-I", "-S", "-c", "import os; os.kill(-1, 9)"],
            **ids,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
            cwd="/",
            timeout=SWEEP_WAIT,
            check=False,
        )


def _wait_gone(pidfds: list[int], timeout: float) -> None:
    """Until every pidfd says its process exited, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    waiting = list(pidfds)
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            waiting.remove(fd)


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
