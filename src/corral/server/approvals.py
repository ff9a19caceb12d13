"""Approval requests waiting for a person: an agent's tools layer asks through the server
(``Remote.approver()``, ``POST /v1/approvals``), the dashboard lists them and a person
approves or denies (``POST /v1/approvals/{id}``). An unanswered request is denied at its
timeout: a missing person never means yes. A request whose asker is gone (its HTTP request
ended) is withdrawn at once: no longer listed, and an answer to it is refused, since nobody
would receive it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal

from corral import errors

__all__ = ["Approvals", "Pending"]

Outcome = Literal["person", "timeout", "withdrawn"]
KEEP_ENDED = 1000
"""How many ended requests are remembered, to say why an answer to one comes too late."""
_TOO_LATE: dict[Outcome, str] = {
    "person": "it was answered already",
    "timeout": "it timed out (denied) before this answer",
    "withdrawn": "it was withdrawn: the agent that asked is gone, so nobody would receive "
    "this answer",
}


@dataclass
class Pending:
    id: str
    tool: str
    command_line: str | None
    reason: str
    box: str | None
    asked_at: float = field(default_factory=time.time)
    answer: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tool": self.tool,
            "command_line": self.command_line,
            "reason": self.reason,
            "box": self.box,
            "asked_at": self.asked_at,
        }


class Approvals:
    def __init__(self) -> None:
        self._pending: dict[str, Pending] = {}
        self._ended: dict[str, Outcome] = {}

    def pending(self) -> list[dict[str, Any]]:
        return [p.describe() for p in self._pending.values()]

    async def ask(
        self,
        tool: str,
        command_line: str | None,
        reason: str,
        box: str | None,
        timeout: float,
        *,
        asker_gone: Awaitable[object] | None = None,
    ) -> tuple[str, bool, Outcome]:
        """Wait for a person's answer: (id, approved, what decided: person|timeout|withdrawn).
        ``asker_gone`` finishes when the asker leaves: the request is withdrawn then (denied,
        unlisted), not left pending for a person to answer into the void."""
        request = Pending("appr-" + secrets.token_hex(6), tool, command_line, reason, box)
        self._pending[request.id] = request
        gone = None if asker_gone is None else asyncio.ensure_future(asker_gone)
        waits: list[asyncio.Future[Any]] = (
            [request.answer] if gone is None else [request.answer, gone]
        )
        outcome: Outcome = "withdrawn"  # also if this wait is cancelled
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            outcome = "person" if request.answer.done() else "withdrawn"
            return request.id, outcome == "person" and request.answer.result(), outcome
        except TimeoutError:
            outcome = "timeout"
            return request.id, False, outcome
        finally:
            self._pending.pop(request.id, None)
            self._ended[request.id] = outcome
            while len(self._ended) > KEEP_ENDED:
                del self._ended[next(iter(self._ended))]
            if gone is not None:
                gone.cancel()

    def decide(self, approval_id: str, approve: bool) -> None:
        """Answer a pending request; one that ended (answered, timed out, withdrawn) or was
        never asked is refused with why, never taken as if someone received it."""
        request = self._pending.get(approval_id)
        if request is None or request.answer.done():
            ended = self._ended.get(approval_id)
            why = "no such request" if request is None and ended is None else None
            if why is None:
                why = _TOO_LATE["person" if ended is None else ended]
            raise errors.SandboxError(
                f"approval {approval_id!r} cannot be answered: {why}",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        request.answer.set_result(approve)
