"""Kernel quotas charged to a user namespace's owner rather than to a cgroup.

``RLIMIT_MSGQUEUE`` (POSIX message queue bytes) is counted per (user namespace, uid) and up
the chain of namespaces: a box's commands are charged in the box's own namespace, checked
against their own rlimit (the agent sets :data:`corral.agent.commands.BOX_MSGQUEUE_BYTES`),
and again in the host's namespace against the limit the namespace's creator had. Every box
is created by the same host uid, so with the default 800 KiB there one box filling its
queues locked every other box out. The creator (bwrap, or the OCI runtime) inherits
corral's own limit, so corral lifts it once: each box is then held by its own cap alone.
"""

from __future__ import annotations

import contextlib
import resource


def lift_msgqueue_limit() -> None:
    """Make ``RLIMIT_MSGQUEUE`` unlimited for this process and the box creators it starts
    (needs CAP_SYS_RESOURCE: the backends that call it run as root)."""
    unlimited = resource.RLIM_INFINITY
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (unlimited, unlimited))
