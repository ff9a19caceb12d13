"""Visibility scopes: a parent agent sees its sub-agents' processes, a sub-agent only its own.

=================== ============ ===========
operation           parent sees  child sees
=================== ============ ===========
list_processes      own + child  own only
read_process_output own + child  own only
kill_process        own only     own only
=================== ============ ===========

Each agent's processes live in its own :class:`~corral.processes.ProcessRegistry` (usually
its own sandbox's), so pids of different owners can collide: every process is reported with
its ``owner`` (``"self"`` or the child's name), and a lookup that finds the pid under two
children asks for the owner instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from corral import errors
from corral.processes import Process, ProcessRegistry

SELF = "self"


@dataclass(frozen=True, slots=True)
class Owned:
    owner: str
    process: Process


class Scope:
    """Own registry plus named child registries."""

    def __init__(self, own: ProcessRegistry) -> None:
        self.own = own
        self._children: dict[str, ProcessRegistry] = {}

    def add_child_registry(self, name: str, registry: ProcessRegistry) -> None:
        """Let this scope read (never kill) the processes of a sub-agent called ``name``."""
        if not name or name == SELF:
            raise errors.SandboxError(
                f"child name {name!r} is reserved or empty; pick another",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        if registry is self.own:
            raise errors.SandboxError(
                "a scope cannot be its own child", code=errors.ErrorCode.INVALID_INPUT
            )
        self._children[name] = registry

    def remove_child_registry(self, name: str) -> None:
        self._children.pop(name, None)

    @property
    def children(self) -> tuple[str, ...]:
        return tuple(self._children)

    def visible(self) -> list[Owned]:
        """Own processes first, then each child's, in the order children were added."""
        found = [Owned(SELF, p) for p in self.own.list()]
        for name, registry in self._children.items():
            found.extend(Owned(name, p) for p in registry.list())
        return found

    def find_visible(self, pid: int, owner: str | None = None) -> Owned:
        """A process this scope may read: own first, then a unique child match."""
        if owner is not None:
            registry = self.own if owner == SELF else self._children.get(owner)
            if registry is None:
                known = ", ".join([SELF, *self._children])
                raise errors.ProcessNotFound(f"unknown owner {owner!r}; known owners: {known}")
            return Owned(owner, registry.get(pid))
        proc = self.own.find(pid)
        if proc is not None:
            return Owned(SELF, proc)
        hits = [Owned(n, p) for n, r in self._children.items() if (p := r.find(pid)) is not None]
        if len(hits) == 1:
            return hits[0]
        if hits:
            names = ", ".join(h.owner for h in hits)
            raise errors.SandboxError(
                f"pid {pid} exists under several sub-agents ({names}); pass owner",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        return Owned(SELF, self.own.get(pid))  # raises ProcessNotFound with the usual hint

    def find_own(self, pid: int) -> Process:
        """A process this scope may signal: only its own, whatever children it can see."""
        proc = self.own.find(pid)
        if proc is not None:
            return proc
        if any(pid in r for r in self._children.values()):
            raise errors.ProcessNotFound(
                f"pid {pid} belongs to a sub-agent; you can read its output but only the "
                "sub-agent can signal it"
            )
        return self.own.get(pid)
