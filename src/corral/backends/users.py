"""Who is who in a box: the box's uids and gids, how they map to host ids, its /etc/passwd.

Inside every box the guest agent is uid 0 and commands run as :data:`BOX_UID`. On the host,
box uid 0..999 and 1001.. map to an unprivileged range starting at :data:`HOST_UID_BASE`
(far above any /etc/subuid range), and box uid 1000 maps either to a host id of the box's
own (:func:`command_id`: shared paths idmapped, see :mod:`corral.backends.host.idmap`) or to
the workspace owner.

Each box's user namespace is *owned* (created) by a host uid of its own, from
:data:`OWNER_UID_BASE` on (see :mod:`corral.backends.host.ucounts`: the kernel charges inotify
and message queue quotas to that owner). On bwrap, which runs as the owner, box uid 0 maps
to it (``root`` of :func:`id_ranges`). Box uid 1000 maps to a host uid of the box's own too,
from the same slot (:func:`command_id`): the kernel counts epoll watches, pipe buffers and
processes per host uid of the process, so a box's commands spend their own budget, never
another box's.
"""

from __future__ import annotations

from corral.errors import BackendError

BOX_UID = 1000
"""uid (and gid) that commands run as inside every box; the agent is uid 0 of the box."""

HOST_UID_BASE = 2_000_000
"""Box uid 0 maps to this unprivileged host uid (far above any /etc/subuid range)."""

ID_RANGE = 65536
"""How many ids a box's user namespace maps."""

OWNER_UID_BASE = HOST_UID_BASE + ID_RANGE
"""First host uid that owns a box's user namespace (one per running box)."""

OWNER_SLOTS = 4096
"""How many boxes may run at once on a host, each with its own namespace owner."""

COMMAND_HOST_ID = 2_001_000
"""Host uid and gid of box uid 1000 (commands) where a box has no owner slot (the microVM
and gVisor, whose commands' kernel is not the host's; tests of idmapped mounts)."""

COMMAND_UID_BASE = OWNER_UID_BASE + OWNER_SLOTS
"""Host uid and gid of box uid 1000 in the box whose namespace owner is ``OWNER_UID_BASE + N``
are ``COMMAND_UID_BASE + N`` (:func:`command_id`)."""


ROOT_BOX_ID_BASE = 1_000_000_000
"""A box whose commands are box root (``policy.user = "root"``) may take any of its ids
(``setuid``: apt's ``_apt`` is uid 42): its ids 1..65535 but 1000 map to a block of host ids
of its own, ``ROOT_BOX_ID_BASE + slot * ID_RANGE`` (:func:`own_block`), so that no two boxes
share a host uid and the kernel's per-uid counts (pipe buffers, epoll watches) of one never
reach another's. Other boxes share the ``HOST_UID_BASE`` range, which their commands (uid
1000, no capabilities) cannot take."""


def own_block(owner: int) -> int:
    """The host id box id 0 of the block of the box whose namespace owner is ``owner`` would
    have (its ids 1..65535 but 1000 are used)."""
    if not OWNER_UID_BASE <= owner < OWNER_UID_BASE + OWNER_SLOTS:
        raise ValueError(f"{owner} is not a namespace owner id")
    return ROOT_BOX_ID_BASE + (owner - OWNER_UID_BASE) * ID_RANGE


def command_id(owner: int) -> int:
    """The host uid and gid of box uid 1000 in the box whose namespace owner is ``owner``."""
    if not OWNER_UID_BASE <= owner < OWNER_UID_BASE + OWNER_SLOTS:
        raise ValueError(f"{owner} is not a namespace owner id")
    return COMMAND_UID_BASE + owner - OWNER_UID_BASE


def _is_command_id(host_id: int) -> bool:
    return (
        host_id == COMMAND_HOST_ID or COMMAND_UID_BASE <= host_id < COMMAND_UID_BASE + OWNER_SLOTS
    )


ROOT_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
)
"""What box root's commands hold beside CAP_SETUID/CAP_SETGID (``policy.user = "root"``):
what package managers need (dpkg chowns what it unpacks, apt drops to ``_apt``), a subset of
Docker's defaults. Capabilities of the box's own user namespace: they reach the box's files
and processes only (host files appear as nobody's, and no uid outside the box is mapped)."""


GUEST_HOME = "/home/user"
"""HOME of the box user."""


def id_ranges(
    owner: int, root: int = HOST_UID_BASE, others: int = HOST_UID_BASE
) -> list[tuple[int, int, int]]:
    """``(box id, host id, count)``: box 0..999 and 1001.. -> host base range, 1000 -> owner;
    box 0 -> ``root`` instead where the box's root is its namespace owner (bwrap); the ids
    but 0 and 1000 from ``others`` on instead of ``HOST_UID_BASE`` (:func:`own_block`)."""
    in_blocks = ROOT_BOX_ID_BASE <= owner < ROOT_BOX_ID_BASE + OWNER_SLOTS * ID_RANGE
    corral_ids = HOST_UID_BASE <= owner < COMMAND_UID_BASE + OWNER_SLOTS
    if in_blocks or (corral_ids and not _is_command_id(owner)):
        raise BackendError(f"workspace owner id {owner} collides with corral's id range")
    head = [(0, others, BOX_UID)]
    if root != others:
        head = [(0, root, 1), (1, others + 1, BOX_UID - 1)]
    return [
        *head,
        (BOX_UID, owner, 1),
        (BOX_UID + 1, others + BOX_UID + 1, ID_RANGE - BOX_UID - 1),
    ]


def id_map(owner: int, root: int = HOST_UID_BASE, others: int = HOST_UID_BASE) -> str:
    """uid_map/gid_map text of :func:`id_ranges`."""
    ranges = id_ranges(owner, root, others)
    return "".join(f"{box} {host} {count}\n" for box, host, count in ranges)


def passwd_text(uid: int, gid: int) -> str:
    """The box's /etc/passwd (every backend, every root): the agent, the box user
    (``uid``/``gid``, named ``user`` as ``USER`` says, full name ``box user``: git's default
    author name) and nobody. The host's accounts are never listed."""
    return (
        "root:x:0:0:box agent:/run/corral:/usr/sbin/nologin\n"
        f"user:x:{uid}:{gid}:box user:{GUEST_HOME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )


def group_text(gid: int) -> str:
    """The box's /etc/group: the agent's, ``tty`` (the owner group of the box's PTYs), the
    box user's and the overflow group."""
    return f"root:x:0:\ntty:x:5:\nuser:x:{gid}:\nnogroup:x:65534:\n"


def rootless_ranges(user_id: int, sub_start: int | None) -> list[tuple[int, int, int]]:
    """``(box id, host id, count)`` of a rootless box (bwrap run by an ordinary user).

    With a subordinate range (``sub_start``, from ``/etc/subuid``/``/etc/subgid``) the box's
    root and every other box id map onto it, and box id 1000 (commands) onto the user's own
    id, as podman's ``keep-id``: what commands write in the workspace belongs to the user on
    the host, and the agent is an id of its own that commands cannot signal or inspect.
    Without one, the kernel maps a single id: box root is the user, and commands run as it
    too (without capabilities)."""
    if sub_start is None:
        return [(0, user_id, 1)]
    return [
        (0, sub_start, BOX_UID),
        (BOX_UID, user_id, 1),
        (BOX_UID + 1, sub_start + BOX_UID, ID_RANGE - BOX_UID - 1),
    ]
