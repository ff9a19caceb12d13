"""Approval requests waiting for a person: an agent's tools layer asks through the server
(``Remote.approver()``, ``POST /v1/approvals``), the dashboard lists them and a person
approves or denies (``POST /v1/approvals/{id}``). An unanswered request is denied at its
timeout: a missing person never means yes."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from corral import errors

__all__ = ["Approvals", "Pending"]


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

    def pending(self) -> list[dict[str, Any]]:
        return [p.describe() for p in self._pending.values()]

    async def ask(
        self, tool: str, command_line: str | None, reason: str, box: str | None, timeout: float
    ) -> tuple[str, bool, str]:
        """Wait for a person's answer: (id, approved, who decided: person|timeout)."""
        request = Pending("appr-" + secrets.token_hex(6), tool, command_line, reason, box)
        self._pending[request.id] = request
        try:
            async with asyncio.timeout(timeout):
                return request.id, await request.answer, "person"
        except TimeoutError:
            return request.id, False, "timeout"
        finally:
            self._pending.pop(request.id, None)

    def decide(self, approval_id: str, approve: bool) -> None:
        request = self._pending.get(approval_id)
        if request is None or request.answer.done():
            raise errors.SandboxError(
                f"no pending approval {approval_id!r} (answered, timed out, or its asker left)",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        request.answer.set_result(approve)
