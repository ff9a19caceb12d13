"""The body of each tool: validated arguments in, a result model out.

Handlers hold no sandbox logic of their own; they call the library and shape its results
into the spec's JSON (the models of :mod:`corral.tools.results`). Errors are raised as
:class:`~corral.errors.SandboxError` and turned into a ``ToolError`` by the toolbox.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from corral.sandbox import Sandbox
from corral.sessions.expect import Case, Match
from corral.sessions.pty import PtySession
from corral.tools import results as r
from corral.tools import schemas as s
from corral.tools.scopes import SELF, Scope
from corral.tools.secrets import SecretStore

BACKGROUND_HINT = (
    "Use wait_for_process to block until exit, or read_process_output to read partial output."
)
SHELL_HINT = "Use shell_write to send commands and shell_read to see output."
MAX_LIST_ENTRIES = 1_000
MAX_READ_BYTES = 8 << 20
EXEC_ARGV = {"sh": ["/bin/sh", "-c"], "python3": ["python3", "-c"], "node": ["node", "-e"]}

RUN_TIMEOUT_SECS = 60.0
"""``run_command``'s timeout when neither the call nor the policy (``exec_timeout_secs``) gives
one."""


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What the handlers work with; the toolbox that dispatches to them makes it."""

    sandbox: Sandbox
    secrets: SecretStore
    scope: Scope
    tool_names: Callable[[], list[str]]
    """The tools the caller may use now (``sandbox_info`` lists them)."""
    share_shells: bool = False
    """Shells opened by ``open_shell`` can be joined with ``corral attach``."""
    output_chars: int = 30_000
    """The toolbox's cap on a result's strings: binary reads are paged to fit in it (cut
    base64 would be garbage)."""
    held: dict[str, str] = field(default_factory=dict)
    """Per shell session, the end of its last output that began a secret value: held back
    from the model until the next read shows whether the value follows (then redacted)."""


def bind(ctx: ToolContext) -> dict[str, Callable[[Any], Awaitable[r.ToolResult]]]:
    h = Handlers(ctx)
    return {
        "run_command": h.run_command,
        "wait_for_process": h.wait_for_process,
        "read_process_output": h.read_process_output,
        "list_processes": h.list_processes,
        "kill_process": h.kill_process,
        "process_stats": h.process_stats,
        "open_shell": h.open_shell,
        "shell_write": h.shell_write,
        "shell_read": h.shell_read,
        "shell_expect": h.shell_expect,
        "shell_expect_cases": h.shell_expect_cases,
        "shell_batch": h.shell_batch,
        "shell_signal": h.shell_signal,
        "vfs_list": h.vfs_list,
        "vfs_read": h.vfs_read,
        "vfs_write": h.vfs_write,
        "sandbox.exec": h.sandbox_exec,
        "sandbox_info": h.sandbox_info,
    }


def _entry(name: str, kind: Any, size: int) -> r.VfsEntry:
    """A listing row; a name that is not UTF-8 is escaped and carried exactly in base64."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = name.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = name.encode("utf-8", "surrogatepass")
        return r.VfsEntry(
            name=raw.decode("utf-8", "backslashreplace"),
            type=kind,
            size=size,
            name_escaped=True,
            name_base64=base64.b64encode(raw).decode("ascii"),
        )
    return r.VfsEntry(name=name, type=kind, size=size)


def _cases(cases: list[s.CaseArgs]) -> list[Case]:
    return [Case(c.pattern, c.tag, c.label, c.respond) for c in cases]


class Handlers:
    def __init__(self, ctx: ToolContext) -> None:
        self.box = ctx
        self.sb = ctx.sandbox

    async def run_command(self, a: s.RunCommandArgs) -> r.RunCommandResult:
        cmd: str | list[str] = [a.command, *a.args] if a.args else a.command
        env = self.box.secrets.resolve_env(a.env) if a.env else None
        if not a.wait:
            proc = await self.sb.spawn(cmd, cwd=a.cwd, env=env)
            return r.RunCommandResult(pid=proc.pid, status="running", hint=BACKGROUND_HINT)
        timeout = a.timeout_secs or self.sb.policy.limits.exec_timeout_secs or RUN_TIMEOUT_SECS
        done = await self.sb.run(cmd, timeout=timeout, cwd=a.cwd, env=env)
        out = r.RunCommandResult(
            pid=done.pid,
            exit_code=done.exit_code,
            ended=done.ended,
            timed_out=done.timed_out,
            timeout_secs=done.timeout,
            stdout=done.stdout,
            stderr=done.stderr,
        )
        if done.oom_killed:
            out.oom_killed = True
        if done.network_refusals:
            out.network_refusals = [
                r.NetworkRefusalResult.model_validate(asdict(refusal))
                for refusal in done.network_refusals
            ]
        return out

    async def wait_for_process(self, a: s.WaitForProcessArgs) -> r.WaitForProcessResult:
        proc = self.box.scope.find_visible(a.pid).process
        # Shielded: a cancelled tool call stops waiting, never the background process (a
        # cancelled Process.wait ends its process).
        waited = await asyncio.shield(proc.wait(a.timeout_ms / 1000))
        return r.WaitForProcessResult.model_validate(waited.to_dict())

    async def read_process_output(self, a: s.ReadProcessOutputArgs) -> r.ReadProcessOutputResult:
        found = self.box.scope.find_visible(a.pid, a.owner)
        proc = found.process
        status = proc.status
        # The output so far: while the process runs, its end may be the start of a secret
        # the next bytes complete, so that end waits for a later read.
        output, _ = self.box.secrets.redact_stream(
            "", proc.output(a.stream), final=status == "exited"
        )
        out = r.ReadProcessOutputResult(pid=proc.pid, stream=a.stream, status=status, output=output)
        if found.owner != SELF:
            out.owner = found.owner
        if proc.exit_code is not None:
            out.exit_code = proc.exit_code
        return out

    async def list_processes(self, a: s.ListProcessesArgs) -> r.ListProcessesResult:
        rows = []
        for owned in self.box.scope.visible():
            info = owned.process.info()
            rows.append(
                r.ProcessRow(
                    owner=owned.owner,
                    pid=info.pid,
                    command=info.command,
                    status=info.status,
                    exit_code=info.exit_code,
                    duration_secs=round(info.duration, 3),
                )
            )
        return r.ListProcessesResult(processes=rows)

    async def kill_process(self, a: s.KillProcessArgs) -> r.KillProcessResult:
        proc = self.box.scope.find_own(a.pid)
        delivered = await proc.signal(a.signal)
        return r.KillProcessResult(pid=proc.pid, signal=a.signal, delivered=delivered)

    async def process_stats(self, a: s.ProcessStatsArgs) -> r.ProcessStatsResult:
        proc = self.box.scope.find_visible(a.pid, a.owner).process
        return r.ProcessStatsResult.model_validate((await proc.stats()).to_dict())

    def _session(self, session_id: str) -> PtySession:
        return self.sb.session(session_id)

    async def open_shell(self, a: s.OpenShellArgs) -> r.OpenShellResult:
        session = await self.sb.shell(a.shell, shared=self.box.share_shells)
        return r.OpenShellResult(
            session_id=session.session_id, shell=session.shell, hint=SHELL_HINT
        )

    async def shell_write(self, a: s.ShellWriteArgs) -> r.ShellWriteResult:
        await self._session(a.session_id).write(a.input)
        return r.ShellWriteResult(session_id=a.session_id, written=len(a.input))

    def _shown(self, session: PtySession, text: str, *, final: bool) -> str:
        """The next piece of a shell's output as the model may see it: redacted together
        with the tail held back from the previous piece, and minus a new such tail."""
        key = session.session_id
        held = self.box.held.pop(key, "")
        shown, held = self.box.secrets.redact_stream(held, text, final=final)
        if held:
            self.box.held[key] = held
        return shown

    def _match_shown(self, session: PtySession, match: Match, cases: bool) -> dict[str, Any]:
        data = match.to_dict(cases=cases)
        final = not match.matched and match.reason == "eof"
        data["output"] = self._shown(session, match.output, final=final)
        return data

    async def shell_read(self, a: s.ShellReadArgs) -> r.ShellReadResult:
        session = self._session(a.session_id)
        output = self._shown(session, session.read(), final=session.closed)
        return r.ShellReadResult(session_id=a.session_id, output=output)

    async def shell_expect(self, a: s.ShellExpectArgs) -> r.ExpectResult:
        session = self._session(a.session_id)
        match = await session.expect(a.pattern, a.timeout_secs)
        return r.ExpectResult.model_validate(self._match_shown(session, match, cases=False))

    async def shell_expect_cases(self, a: s.ShellExpectCasesArgs) -> r.ExpectCasesResult:
        session = self._session(a.session_id)
        match = await session.expect_cases(_cases(a.cases), a.timeout_secs)
        return r.ExpectCasesResult.model_validate(self._match_shown(session, match, cases=True))

    async def shell_batch(self, a: s.ShellBatchArgs) -> r.ShellBatchResult:
        session = self._session(a.session_id)
        steps = [step.model_dump(exclude_none=True) for step in a.steps]
        result = (await session.batch(steps, a.timeout_secs)).to_dict()
        for step in result["steps"]:  # in order: each expect's output follows the last one's
            if isinstance(step.get("output"), str):
                step["output"] = self._shown(session, step["output"], final=False)
        return r.ShellBatchResult.model_validate(result)

    async def shell_signal(self, a: s.ShellSignalArgs) -> r.ShellSignalResult:
        delivered = await self._session(a.session_id).signal(a.signal)
        return r.ShellSignalResult(session_id=a.session_id, signal=a.signal, delivered=delivered)

    async def vfs_list(self, a: s.VfsListArgs) -> r.VfsListResult:
        entries = await self.sb.files.list(a.path)
        rows = sorted((_entry(e.name, e.type, e.size) for e in entries), key=lambda row: row.name)
        out = r.VfsListResult(path=a.path, entries=rows[:MAX_LIST_ENTRIES])
        if len(rows) > MAX_LIST_ENTRIES:
            out.truncated = True
            out.total_entries = len(rows)
        return out

    async def vfs_read(self, a: s.VfsReadArgs) -> r.VfsReadResult:
        """Text as it is; binary content (NUL bytes, or not UTF-8) as base64, paged so that
        its base64 fits in the toolbox's output cap (``offset``/``length``/``eof`` say where
        the next page starts)."""
        ranged = a.limit is not None or a.offset > 0
        if not ranged:  # the whole file, at most 8 MiB
            data = await self.sb.files.read(a.path, max_bytes=MAX_READ_BYTES)
            size = len(data)
        else:
            info = await self.sb.files.stat(a.path)
            size = info.size if info is not None else 0
            length = a.limit if a.limit is not None else MAX_READ_BYTES
            data = await self.sb.files.read(a.path, offset=a.offset, length=length)
        text = _utf8_text(data, whole=a.offset + len(data) >= size)
        if text is not None and not ranged:
            return r.VfsReadResult(path=a.path, size=size, encoding="utf-8", content=text)
        if text is not None:
            used = len(text.encode())  # a character cut at the end is left for the next read
            return r.VfsReadResult(
                path=a.path,
                size=size,
                encoding="utf-8",
                content=text,
                offset=a.offset,
                length=used,
                eof=a.offset + used >= size,
            )
        page = max(3, (self.box.output_chars - 200) // 4 * 3)
        data = data[:page]
        return r.VfsReadResult(
            path=a.path,
            size=size,
            binary=True,
            encoding="base64",
            content=base64.b64encode(data).decode(),
            offset=a.offset,
            length=len(data),
            eof=a.offset + len(data) >= size,
        )

    async def vfs_write(self, a: s.VfsWriteArgs) -> r.VfsWriteResult | r.ToolError:
        content: str | bytes = a.content
        if a.encoding == "base64":
            try:
                content = base64.b64decode(a.content, validate=True)
            except ValueError as exc:
                return r.ToolError.of("invalid_input", f"content is not base64: {exc}")
        size = await self.sb.files.write(a.path, content, append=a.append)
        return r.VfsWriteResult(path=a.path, size=size)

    async def sandbox_exec(self, a: s.SandboxExecArgs) -> r.SandboxExecResult | r.ToolError:
        # Resolved here, at process start, and only into the child's environment.
        env = self.box.secrets.resolve(a.secrets) if a.secrets else None
        argv = [*EXEC_ARGV[a.runtime], a.code]
        done = await self.sb.run(argv, timeout=a.timeout_ms / 1000, stdin=a.stdin, env=env)
        if done.ended == "not_started" and done.exit_code == 127:
            return r.ToolError.of("runtime_not_found", f"runtime not found: {a.runtime}")
        if done.timed_out:
            return r.SandboxExecResult(
                error=r.ErrorInfo(code="timeout", message="timeout"),
                stdout=done.stdout,
                stderr=done.stderr,
                exit_code=done.exit_code,
            )
        return r.SandboxExecResult(stdout=done.stdout, stderr=done.stderr, exit_code=done.exit_code)

    async def sandbox_info(self, a: s.SandboxInfoArgs) -> r.SandboxInfoResult:
        info = await self.sb.info()
        return r.SandboxInfoResult.model_validate({**info, "tools": self.box.tool_names()})


def _utf8_text(data: bytes, whole: bool) -> str | None:
    """``data`` as text, or None for binary content (NUL bytes, or not UTF-8). Not ``whole``:
    a multi-byte character cut at the end is dropped (the caller reports the bytes used)."""
    if b"\x00" in data:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        return decoder.decode(data, final=whole)
    except UnicodeDecodeError:
        return None
