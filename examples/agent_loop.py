"""A scripted agent (no LLM) that replays the spec's five scenarios through MCP over stdio.

Run it from the repository root::

    .venv/bin/python examples/agent_loop.py

It starts ``python -m corral mcp`` (what ``corral mcp`` runs) as a subprocess, connects
with the official MCP client, and prints every tool call and its result, as a model would see
them. Each scenario checks the results it needs; the script exits 1 naming the first that
was wrong (``tests/test_examples.py`` runs it). Scenario 1 needs a rustup toolchain in ~/.cargo
and ~/.rustup (shared read-only into the box by the ``rust`` preset); without one it is
skipped.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

CRATE_TOML = '[package]\nname = "myproject"\nversion = "0.1.0"\nedition = "2021"\n'
BROKEN_MAIN = (
    'fn answer() -> String {\n    42u32\n}\n\nfn main() {\n    println!("{}", answer());\n}\n'
)
FIXED_MAIN = BROKEN_MAIN.replace("42u32", "42u32.to_string()")
# A stand-in for `terraform apply`: prints a plan, asks, then applies.
FAKE_TERRAFORM = """\
echo 'Terraform will perform the following actions:'
echo '  + resource "aws_instance" "web"'
echo 'Plan: 1 to add, 0 to change, 0 to destroy.'
printf '  Enter a value: '
read answer
[ "$answer" = yes ] && echo 'Apply complete! Resources: 1 added, 0 changed, 0 destroyed.'
"""
# A tool that prints its version and asks a question (scenario 4), and a test run (scenario 5).
# They are files run by name, so what the agent matches is their output: a pattern that matched
# the command line typed into the terminal would be matching the terminal's echo of it.
FAKE_TOOL = """\
echo "mytool version 1.7"
read reply
echo "got: $reply"
"""
FAKE_TESTS = """\
passed=$((40 + 7))
echo "tests: $passed passed"
"""


class ScenarioFailed(Exception):
    """A tool result was not what the scenario needs (the demo exits 1 saying which)."""


def need(ok: bool, what: str) -> None:
    if not ok:
        raise ScenarioFailed(what)


class ScriptedAgent:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        print(f"\n>>> {name} {json.dumps(arguments)}")
        result = await self.client.call_tool(name, arguments)
        data: dict[str, Any] = result.structured_content or {}
        shown = json.dumps(data, indent=2)
        print(shown if len(shown) < 1500 else shown[:1500] + "\n    ...")
        return data

    async def scenario_1_compile(self) -> None:
        print("\n=== 1. oneshot: cargo check, fix, check again")
        check = {"command": "cargo", "args": ["check", "--message-format=json"], "timeout_secs": 60}
        first = await self.tool("run_command", check)
        need(first.get("exit_code") == 101, "cargo check reports the type error")
        await self.tool("vfs_write", {"path": "src/main.rs", "content": FIXED_MAIN})
        second = await self.tool("run_command", check)
        need(second.get("exit_code") == 0, "cargo check passes after the fix")

    async def scenario_2_background(self) -> None:
        print("\n=== 2. background job, polled")
        job = "for i in 1 2 3; do echo test $i passed >&2; sleep 0.3; done; echo Summary >&2"
        started = await self.tool("run_command", {"command": job, "wait": False})
        pid = started["pid"]
        await self.tool("wait_for_process", {"pid": pid, "timeout_ms": 200})
        await self.tool("read_process_output", {"pid": pid, "stream": "stderr"})
        done = await self.tool("wait_for_process", {"pid": pid, "timeout_ms": 10_000})
        need(done.get("status") == "exited", "the background job exits within 10 s")
        out = await self.tool("read_process_output", {"pid": pid, "stream": "stderr"})
        need("Summary" in str(out), "the job's whole stderr is readable")

    async def scenario_3_confirmation(self) -> str:
        print("\n=== 3. a CLI asks for confirmation: find the prompt, hand it to the user")
        await self.tool("vfs_write", {"path": "terraform.sh", "content": FAKE_TERRAFORM})
        session = (await self.tool("open_shell", {"shell": "/bin/sh"}))["session_id"]
        await self.tool("shell_write", {"session_id": session, "input": "sh terraform.sh\n"})
        prompt = {"session_id": session, "pattern": "Enter a value:", "timeout_secs": 30}
        need((await self.tool("shell_expect", prompt)).get("matched") is True, "the prompt")
        print("\n(agent to user: the plan adds 1 resource; type `yes` in the terminal to apply)")
        # Here the human types into the terminal (`corral attach`); the script plays them.
        await self.tool("shell_write", {"session_id": session, "input": "yes\n"})
        done = {"session_id": session, "pattern": "Apply complete!", "timeout_secs": 30}
        applied = await self.tool("shell_expect", done)
        need(applied.get("matched") is True, "the apply completes after `yes`")
        return str(session)

    async def scenario_4_cases(self, session: str) -> None:
        print("\n=== 4. several possible outcomes: shell_expect_cases with respond")
        await self.tool("vfs_write", {"path": "mytool.sh", "content": FAKE_TOOL})
        await self.tool("shell_write", {"session_id": session, "input": "sh mytool.sh\n"})
        cases = [
            {"pattern": "password:", "tag": "needs_user", "label": "Password prompt"},
            {
                "pattern": "Are you sure you want to continue connecting",
                "tag": "needs_user",
                "label": "Host key verification",
            },
            {
                "pattern": r"version (\d+\.\d+)",
                "tag": "ok",
                "label": "Version detected",
                "respond": "Detected version $1\n",
            },
        ]
        found = await self.tool("shell_expect_cases", {"session_id": session, "cases": cases})
        need(found.get("tag") == "ok", "the version line matches the 'ok' case")
        need(found.get("captures", [])[1:] == ["1.7"], "the version is captured")
        # The tool read the automatic response: "got: " is printed by the tool, never typed.
        got = {"session_id": session, "pattern": r"got: Detected version 1\.7"}
        need((await self.tool("shell_expect", got)).get("matched") is True, "the tool got it")

    async def scenario_5_batch(self, session: str) -> None:
        print("\n=== 5. a scripted flow in one call: shell_batch")
        await self.tool("vfs_write", {"path": "run_tests.sh", "content": FAKE_TESTS})
        steps = [
            {"type": "send", "input": "ls\n"},
            {"type": "expect", "pattern": r"terraform\.sh", "timeout_secs": 5},
            {"type": "send", "input": "sh run_tests.sh\n"},
            {
                "type": "expect_cases",
                "cases": [
                    {"pattern": r"tests: \d+ passed", "tag": "ok", "label": "Tests passed"},
                    {"pattern": "FAILED", "tag": "fail", "label": "Tests failed"},
                ],
            },
        ]
        batch = {"session_id": session, "steps": steps, "timeout_secs": 30}
        result = await self.tool("shell_batch", batch)
        need(result.get("completed") == len(steps), "every step of the batch succeeds")
        need(result["steps"][-1].get("tag") == "ok", "the test run passed")


async def main() -> int:
    with tempfile.TemporaryDirectory(prefix="corral-demo-") as tmp:
        workspace = Path(tmp)
        (workspace / "src").mkdir()
        (workspace / "Cargo.toml").write_text(CRATE_TOML, encoding="utf-8")
        (workspace / "src" / "main.rs").write_text(BROKEN_MAIN, encoding="utf-8")
        has_rust = (Path.home() / ".cargo" / "bin" / "cargo").exists()
        args = ["-m", "corral", "mcp", "--workspace", str(workspace)]
        args += ["--preset", "rust"] if has_rust else []
        server = StdioServerParameters(command=sys.executable, args=args)
        async with Client(server) as client:
            agent = ScriptedAgent(client)
            tools = (await client.list_tools()).tools
            print(f"connected: {len(tools)} tools: {', '.join(t.name for t in tools)}")
            try:
                if has_rust:
                    await agent.scenario_1_compile()
                else:
                    print("\n=== 1. skipped: no rustup toolchain in ~/.cargo")
                await agent.scenario_2_background()
                session = await agent.scenario_3_confirmation()
                await agent.scenario_4_cases(session)
                await agent.scenario_5_batch(session)
            except ScenarioFailed as exc:
                print(f"\nFAILED: {exc}")
                return 1
    print("\nall scenarios passed")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
