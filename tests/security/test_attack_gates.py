"""Class 4 of issue 13: every path by which text reaches a shell passes the approval gate,
and a rule matches what will run, not one spelling of it. Real boxes, through Toolbox.call."""

from __future__ import annotations

from typing import Any

import pytest

from corral import Sandbox
from corral.tools import Rule, Toolbox
from corral.tools.approvals import Gate, command_variants

pytestmark = pytest.mark.needs_bwrap

PUSH = Rule(command=r"^git\s+push\b", outcome="deny", reason="no pushing")
CANARY = "corral-gate-canary"


def typing_calls(session_id: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """Each tool call that types ``text`` into the shell, one per path."""
    case = {"pattern": r"\$ ?$", "respond": text}
    return [
        ("shell_write", {"session_id": session_id, "input": text}),
        ("shell_expect_cases", {"session_id": session_id, "cases": [case], "timeout_secs": 5}),
        ("shell_batch", {"session_id": session_id, "steps": [{"type": "send", "input": text}]}),
        (
            "shell_batch",
            {
                "session_id": session_id,
                "steps": [{"type": "expect_cases", "cases": [case], "timeout_secs": 5}],
            },
        ),
    ]


async def _shell(tools: Toolbox) -> str:
    opened = await tools.call("open_shell", {})
    return str(opened["session_id"])


async def test_read_only_mode_types_nothing_by_any_path(sandbox: Sandbox) -> None:
    writer = Toolbox(sandbox)
    session_id = await _shell(writer)
    reader = Toolbox(sandbox, permission_mode="read-only")
    for tool, arguments in typing_calls(session_id, f"touch {CANARY}\n"):
        result = await reader.call(tool, arguments)
        assert result.get("error", {}).get("code") == "approval_denied", (tool, result)
    # Nothing reached the shell: the file was never made.
    done = await sandbox.run(["sh", "-c", f"test -e {CANARY}; echo $?"])
    assert done.stdout.strip() == "1"
    # Watching without typing stays allowed in read-only mode.
    watch = {"session_id": session_id, "cases": [{"pattern": "."}], "timeout_secs": 0.2}
    result = await reader.call("shell_expect_cases", watch)
    assert result.get("error", {}).get("code") != "approval_denied"


@pytest.mark.parametrize(
    "spelling",
    [
        "git push\n",
        "/usr/bin/git push\n",
        "GIT_DIR=/x git   push\n",
        "'git' \"push\"\n",
        "git \\\npush\n",
        "true && git push\n",
        "echo a; git push\n",
        "echo a | git push\n",
        "sh -c 'git push'\n",
        'env -i PATH=/usr/bin bash -lc "git push origin"\n',
        "echo ok\ngit push\n",
    ],
)
async def test_a_rule_holds_for_every_spelling_and_every_path(
    sandbox: Sandbox, spelling: str
) -> None:
    tools = Toolbox(sandbox, rules=[PUSH])
    session_id = await _shell(tools)
    for tool, arguments in typing_calls(session_id, spelling):
        result = await tools.call(tool, arguments)
        assert result.get("error", {}).get("code") == "approval_denied", (tool, spelling)


async def test_text_no_rule_matches_still_runs(sandbox: Sandbox) -> None:
    tools = Toolbox(sandbox, rules=[PUSH])
    session_id = await _shell(tools)
    batch = {
        "session_id": session_id,
        "steps": [
            {"type": "send", "input": "echo git-pushed-nothing; git status >/dev/null 2>&1\n"},
            {"type": "expect", "pattern": "git-pushed-nothing\r?\n", "timeout_secs": 10},
        ],
    }
    result = await tools.call("shell_batch", batch)
    assert "error" not in result, result


def test_variants_name_each_simple_command() -> None:
    found = command_variants("FOO=1 /usr/bin/git 'push' && sh -c 'rm -rf /tmp/x'")
    assert "git push" in found and "rm -rf /tmp/x" in found
    # Quoted separators are text, not separators.
    assert "echo a;b" in command_variants("echo 'a;b'")


def test_ask_rules_see_typed_responses() -> None:
    gate = Gate()  # the default rules ask about git push
    case = {"pattern": "[$] $", "respond": "/usr/bin/git push -f\n"}
    verdict = gate.verdict("shell_expect_cases", {"session_id": "s", "cases": [case]})
    assert verdict.outcome == "ask"


ASKED = [
    "git -C . push",
    "git -c user.name=x push",
    "git --git-dir=.git --no-pager push origin main",
    "rm -r -f build",
    "rm -R -f build",
    "rm --recursive --force build",
    "rm -f -r build",
    "terraform -chdir=infra apply",
    "kubectl -n prod delete pod x",
    "kubectl --context prod --namespace=prod delete pod x",
]
NOT_ASKED = ["git -C . status", "rm -r build", "rm -f x", "kubectl -n prod get pods"]


@pytest.mark.parametrize("command", ASKED)
async def test_default_rules_see_global_options_and_split_flags(
    sandbox: Sandbox, command: str
) -> None:
    """The default rules' tools take options before the subcommand, and rm's flags come
    split or long: these are the common spellings, no runtime trick."""
    result = await Toolbox(sandbox).call("run_command", {"command": command})
    assert result.get("error", {}).get("code") == "approval_required", (command, result)


@pytest.mark.parametrize("command", NOT_ASKED)
def test_default_rules_still_let_the_harmless_spellings_run(command: str) -> None:
    assert Gate().verdict("run_command", {"command": command}).outcome == "allow"
