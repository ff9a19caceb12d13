"""``shell_batch``: a scripted send / expect / expect_cases sequence in one call.

Steps are validated (and their patterns compiled) before anything is sent, so a typo in
step 3 cannot leave steps 1 and 2 half-done. Execution stops at the first failing step and
the partial results are returned: a failed step is a result (``success: false`` with an
``error``), like a timed-out expect.

The batch ``timeout`` is the default for each expect step that gives no ``timeout_secs``
(the spec's example has steps whose own timeouts exceed it, so it is not a total budget).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from corral import errors
from corral.sessions.expect import Case, Match

__all__ = [
    "BatchResult",
    "BatchStep",
    "ExpectCasesStep",
    "ExpectStep",
    "SendStep",
    "Session",
    "StepCase",
    "StepResult",
    "run_batch",
]


class _Step(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SendStep(_Step):
    """Type ``input`` into the terminal (include ``\\n`` to press Enter)."""

    type: Literal["send"] = "send"
    input: str


class ExpectStep(_Step):
    """Wait for ``pattern`` (a regex) in the output."""

    type: Literal["expect"] = "expect"
    pattern: str
    timeout_secs: float | None = Field(default=None, ge=0)


class StepCase(_Step):
    pattern: str
    tag: str | None = None
    label: str | None = None
    respond: str | None = None


class ExpectCasesStep(_Step):
    """Wait for the first of several cases; a case's ``respond`` is sent when it matches."""

    type: Literal["expect_cases"] = "expect_cases"
    cases: list[StepCase] = Field(min_length=1)
    timeout_secs: float | None = Field(default=None, ge=0)


BatchStep = Annotated[SendStep | ExpectStep | ExpectCasesStep, Field(discriminator="type")]
_STEPS: pydantic.TypeAdapter[list[BatchStep]] = pydantic.TypeAdapter(list[BatchStep])


@dataclass(frozen=True, slots=True)
class StepResult:
    index: int
    step_type: Literal["send", "expect", "expect_cases"]
    success: bool
    match: Match | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "step_type": self.step_type,
            "success": self.success,
        }
        if self.match is not None:
            data["output"] = self.match.output
            if self.match.matched:
                data["captures"] = list(self.match.captures)
            if self.step_type == "expect_cases" and self.match.matched:
                data.update(
                    matched_case=self.match.matched_case, tag=self.match.tag, label=self.match.label
                )
        if self.error is not None:
            data["error"] = self.error
        return data


@dataclass(frozen=True, slots=True)
class BatchResult:
    steps: list[StepResult]
    completed: int
    """Steps that succeeded (all of them when ``completed == total``)."""
    total: int

    @property
    def success(self) -> bool:
        return self.completed == self.total

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.to_dict() for s in self.steps],
            "completed": self.completed,
            "total": self.total,
        }


def parse_steps(steps: Sequence[BatchStep | Mapping[str, Any]]) -> list[BatchStep]:
    """Validate tool-shaped dicts or step models, and compile every pattern, up front."""
    raw = [s.model_dump() if isinstance(s, BaseModel) else s for s in steps]
    try:
        parsed = _STEPS.validate_python(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise errors.SandboxError(
            f"invalid batch step at {where}: {first['msg']}; steps are "
            "{type: send, input} | {type: expect, pattern} | {type: expect_cases, cases}",
            code=errors.ErrorCode.INVALID_INPUT,
        ) from None
    for step in parsed:
        _cases(step)  # raises INVALID_INPUT for a bad regex or a bad $N in a response
    return parsed


def _cases(step: BatchStep) -> list[Case]:
    if isinstance(step, ExpectStep):
        return [Case(step.pattern)]
    if isinstance(step, ExpectCasesStep):
        return [Case(c.pattern, c.tag, c.label, c.respond) for c in step.cases]
    return []


def _failure(match: Match, timeout: float | None) -> str:
    what = repr(match.pattern) if match.pattern else "any of the cases"
    if match.reason == "eof":
        return f"eof: the shell exited before {what} appeared"
    return f"timeout: {what} did not appear within {timeout or 0:g} s"


class Session(Protocol):
    """What a batch needs of a session (a :class:`~corral.sessions.pty.PtySession`)."""

    async def write(self, data: str | bytes) -> None: ...

    async def expect(self, pattern: str, timeout: float | None = ...) -> Match: ...

    async def expect_cases(
        self, cases: Sequence[Case | Mapping[str, Any]], timeout: float | None = ...
    ) -> Match: ...


async def run_batch(
    session: Session,
    steps: Sequence[BatchStep | Mapping[str, Any]],
    timeout: float | None = 30.0,
) -> BatchResult:
    parsed = parse_steps(steps)
    results: list[StepResult] = []
    for index, step in enumerate(parsed):
        if isinstance(step, SendStep):
            try:
                await session.write(step.input)
            except errors.SessionError as exc:
                results.append(StepResult(index, "send", False, error=exc.message))
                break
            results.append(StepResult(index, "send", True))
            continue
        limit = step.timeout_secs if step.timeout_secs is not None else timeout
        if isinstance(step, ExpectStep):
            match = await session.expect(step.pattern, limit)
        else:
            match = await session.expect_cases(_cases(step), limit)
        error = None if match.matched else _failure(match, limit)
        results.append(StepResult(index, step.type, match.matched, match, error))
        if not match.matched:
            break
    completed = sum(r.success for r in results)
    return BatchResult(results, completed, len(parsed))
