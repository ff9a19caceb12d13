"""The agent tools follow the sandbox's policy: run_command's default timeout is the policy's
``exec_timeout_secs``, the Toolbox reads ``secrets_file``, and process_stats after the exit
reports the final figures (CPU used, peak memory), not zeros."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral import Policy, Sandbox
from corral.policy import Limits
from corral.tools import Toolbox
from corral.tools.handlers import RUN_TIMEOUT_SECS


async def test_run_command_takes_the_policy_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = Policy(limits=Limits(exec_timeout_secs=0.5, kill_grace_secs=0))
    async with Sandbox(policy, workspace=tmp_path) as sb:
        tools = Toolbox(sb)
        r = await tools.call("run_command", {"command": "sleep 30"})
        assert r["timed_out"] is True
        quick = await tools.call("run_command", {"command": "echo ok", "timeout_secs": 5})
        assert quick["stdout"] == "ok\n"
    async with Sandbox(workspace=tmp_path) as sb:  # no policy timeout: the tool's default
        seen: list[float | None] = []
        real_run = sb.run

        async def spy(*args: object, **kwargs: object) -> object:
            seen.append(kwargs.get("timeout"))  # type: ignore[arg-type]
            return await real_run(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(sb, "run", spy)
        await Toolbox(sb).call("run_command", {"command": "true"})
        assert seen == [RUN_TIMEOUT_SECS]


async def test_the_toolbox_reads_the_policy_secrets_file(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text("API_TOKEN=tok-0123456789abcdef\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    async with Sandbox(Policy(secrets_file=secrets), workspace=ws) as sb:
        tools = Toolbox(sb)
        r = await tools.call(
            "run_command",
            {"command": 'echo "${#TOKEN} $TOKEN"', "env": {"TOKEN": "{{secret:API_TOKEN}}"}},
        )
    assert r["exit_code"] == 0, r
    assert r["stdout"].startswith("20 ")
    assert "tok-0123456789abcdef" not in r["stdout"]  # redacted on the way back


async def test_process_stats_after_exit_are_the_final_figures(tmp_path: Path) -> None:
    async with Sandbox(workspace=tmp_path) as sb:
        tools = Toolbox(sb)
        started = await tools.call(
            "run_command",
            {
                "command": "python3 -c 'b = bytearray(64 << 20); sum(range(3_000_000))'",
                "wait": False,
            },
        )
        await tools.call("wait_for_process", {"pid": started["pid"], "timeout_ms": 30_000})
        stats = await tools.call("process_stats", {"pid": started["pid"]})
    assert stats["status"] == "exited"
    assert stats["cpu_seconds"] > 0
    assert stats["rss_bytes"] >= 64 << 20
    assert stats["processes"] == 0
