"""The body of each tool: validated arguments in, a JSON-ready dict out.

Handlers hold no sandbox logic of their own; they call the library and shape its results
into the spec's JSON. Errors are raised as :class:`~corral.errors.SandboxError` and turned
into ``{"error": ...}`` by the toolbox.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from corral import errors
from corral.sandbox import Sandbox
from corral.sessions.expect import Case
from corral.sessions.pty import PtySession
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


def bind(ctx: ToolContext) -> dict[str, Callable[[Any], Awaitable[dict[str, Any]]]]:
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


def _cases(cases: list[s.CaseArgs]) -> list[Case]:
    return [Case(c.pattern, c.tag, c.label, c.respond) for c in cases]


class Handlers:
    def __init__(self, ctx: ToolContext) -> None:
        self.box = ctx
        self.sb = ctx.sandbox

    async def run_command(self, a: s.RunCommandArgs) -> dict[str, Any]:
        cmd: str | list[str] = [a.command, *a.args] if a.args else a.command
        env = self.box.secrets.resolve_env(a.env) if a.env else None
        if not a.wait:
            proc = await self.sb.spawn(cmd, cwd=a.cwd, env=env)
            return {"pid": proc.pid, "status": "running", "hint": BACKGROUND_HINT}
        r = await self.sb.run(cmd, timeout=a.timeout_secs, cwd=a.cwd, env=env)
        out: dict[str, Any] = {
            "pid": r.pid,
            "exit_code": r.exit_code,
            "timed_out": r.timed_out,
            "stdout": r.stdout,
            "stderr": r.stderr,
        }
        if r.oom_killed:
            out["oom_killed"] = True
        if r.network_refusals:
            out["network_refusals"] = [asdict(refusal) for refusal in r.network_refusals]
        return out

    async def wait_for_process(self, a: s.WaitForProcessArgs) -> dict[str, Any]:
        proc = self.box.scope.find_visible(a.pid).process
        return (await proc.wait(a.timeout_ms / 1000)).to_dict()

    async def read_process_output(self, a: s.ReadProcessOutputArgs) -> dict[str, Any]:
        found = self.box.scope.find_visible(a.pid, a.owner)
        proc = found.process
        out: dict[str, Any] = {"pid": proc.pid, "stream": a.stream, "status": proc.status}
        if found.owner != SELF:
            out["owner"] = found.owner
        if proc.exit_code is not None:
            out["exit_code"] = proc.exit_code
        out["output"] = proc.output(a.stream)
        return out

    async def list_processes(self, a: s.ListProcessesArgs) -> dict[str, Any]:
        rows = []
        for owned in self.box.scope.visible():
            info = owned.process.info()
            rows.append(
                {
                    "owner": owned.owner,
                    "pid": info.pid,
                    "command": info.command,
                    "status": info.status,
                    "exit_code": info.exit_code,
                    "duration_secs": round(info.duration, 3),
                }
            )
        return {"processes": rows}

    async def kill_process(self, a: s.KillProcessArgs) -> dict[str, Any]:
        proc = self.box.scope.find_own(a.pid)
        delivered = await proc.signal(a.signal)
        return {"pid": proc.pid, "signal": a.signal, "delivered": delivered}

    async def process_stats(self, a: s.ProcessStatsArgs) -> dict[str, Any]:
        proc = self.box.scope.find_visible(a.pid, a.owner).process
        return (await proc.stats()).to_dict()

    def _session(self, session_id: str) -> PtySession:
        return self.sb.session(session_id)

    async def open_shell(self, a: s.OpenShellArgs) -> dict[str, Any]:
        session = await self.sb.shell(a.shell, shared=self.box.share_shells)
        return {"session_id": session.session_id, "shell": session.shell, "hint": SHELL_HINT}

    async def shell_write(self, a: s.ShellWriteArgs) -> dict[str, Any]:
        await self._session(a.session_id).write(a.input)
        return {"session_id": a.session_id, "written": len(a.input)}

    async def shell_read(self, a: s.ShellReadArgs) -> dict[str, Any]:
        return {"session_id": a.session_id, "output": self._session(a.session_id).read()}

    async def shell_expect(self, a: s.ShellExpectArgs) -> dict[str, Any]:
        match = await self._session(a.session_id).expect(a.pattern, a.timeout_secs)
        return match.to_dict()

    async def shell_expect_cases(self, a: s.ShellExpectCasesArgs) -> dict[str, Any]:
        session = self._session(a.session_id)
        match = await session.expect_cases(_cases(a.cases), a.timeout_secs)
        return match.to_dict(cases=True)

    async def shell_batch(self, a: s.ShellBatchArgs) -> dict[str, Any]:
        session = self._session(a.session_id)
        steps = [step.model_dump(exclude_none=True) for step in a.steps]
        result = await session.batch(steps, a.timeout_secs)
        data = result.to_dict()
        assert isinstance(data, dict)
        return data

    async def shell_signal(self, a: s.ShellSignalArgs) -> dict[str, Any]:
        delivered = await self._session(a.session_id).signal(a.signal)
        return {"session_id": a.session_id, "signal": a.signal, "delivered": delivered}

    async def vfs_list(self, a: s.VfsListArgs) -> dict[str, Any]:
        entries = await self.sb.files.list(a.path)
        rows = [{"name": e.name, "type": e.type, "size": e.size} for e in entries]
        rows.sort(key=lambda r: str(r["name"]))
        out: dict[str, Any] = {"path": a.path, "entries": rows[:MAX_LIST_ENTRIES]}
        if len(rows) > MAX_LIST_ENTRIES:
            out["truncated"] = True
            out["total_entries"] = len(rows)
        return out

    async def vfs_read(self, a: s.VfsReadArgs) -> dict[str, Any]:
        data = await self.sb.files.read(a.path, max_bytes=MAX_READ_BYTES)
        out: dict[str, Any] = {"path": a.path, "size": len(data)}
        if b"\x00" in data[:8192]:
            out["binary"] = True
            out["content"] = ""
            return out
        out["content"] = data.decode("utf-8", errors="replace")
        return out

    async def vfs_write(self, a: s.VfsWriteArgs) -> dict[str, Any]:
        size = await self.sb.files.write(a.path, a.content, append=a.append)
        return {"path": a.path, "size": size}

    async def sandbox_exec(self, a: s.SandboxExecArgs) -> dict[str, Any]:
        # Resolved here, at process start, and only into the child's environment.
        env = self.box.secrets.resolve(a.secrets) if a.secrets else None
        argv = [*EXEC_ARGV[a.runtime], a.code]
        try:
            r = await self.sb.run(argv, timeout=a.timeout_ms / 1000, stdin=a.stdin, env=env)
        except errors.SpawnFailed as exc:
            if "not found" in exc.message:
                return {
                    "error": {
                        "code": "runtime_not_found",
                        "message": f"runtime not found: {a.runtime}",
                    }
                }
            raise
        out: dict[str, Any] = {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}
        if r.timed_out:
            return {"error": {"code": "timeout", "message": "timeout"}, **out}
        return out

    async def sandbox_info(self, a: s.SandboxInfoArgs) -> dict[str, Any]:
        info = await self.sb.info()
        info["tools"] = self.box.tool_names()
        return info
