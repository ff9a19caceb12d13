"""PTY sessions in real sandboxes: expect, cases, batches, signals, terminal behaviour."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from conftest import PROMPT
from corral import Policy, Sandbox
from corral.errors import ErrorCode, SandboxError, SessionBusy, SessionNotFound
from corral.sessions.batch import ExpectStep, SendStep
from corral.sessions.pty import PtySession

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.usefixtures("sessions_dir")]

# A terraform-like program: prints a plan, asks, and reports. The prompt text never appears
# in the command line we type, so the terminal's echo cannot satisfy an expect by accident.
PLAN_SCRIPT = """\
echo "Terraform will perform the following actions:"
echo "  + resource aws_instance.web"
echo "Plan: 1 to add, 0 to change, 0 to destroy."
printf "  Enter a value: "
read answer
if [ "$answer" = yes ]; then echo "Apply complete! Resources: 1 added."
else echo "Apply cancelled."; fi
"""


async def test_prompting_program_is_detected_answered_and_completes(
    sh: PtySession, workspace: Path
) -> None:
    (workspace / "plan.sh").write_text(PLAN_SCRIPT)
    await sh.write("sh plan.sh\n")
    prompt = await sh.expect("Enter a value:", 10)
    assert prompt.matched and prompt.to_dict()["pattern"] == "Enter a value:"
    assert "Plan: 1 to add" in prompt.output and prompt.output.endswith("Enter a value:")
    await sh.write("yes\n")
    done = await sh.expect(r"Apply complete! Resources: (\d+) added", 10)
    assert done.matched and done.captures[1] == "1"


async def test_expect_cases_picks_the_case_and_responds_with_its_capture(
    sh: PtySession, workspace: Path
) -> None:
    (workspace / "v.sh").write_text('echo "tool version 3.7"; read line; echo "got: $line"\n')
    await sh.write("sh v.sh\n")
    cases = [
        {"pattern": "password:", "tag": "needs_user", "label": "Password prompt"},
        {"pattern": r"version (\d+\.\d+)", "tag": "ok", "label": "Version", "respond": "v=$1\n"},
    ]
    m = await sh.expect_cases(cases, 10)
    assert (m.matched, m.matched_case, m.tag, m.label) == (True, 1, "ok", "Version")
    assert m.to_dict(cases=True)["captures"] == ["version 3.7", "3.7"]
    assert (await sh.expect(r"got: v=3\.7", 10)).matched


async def test_batch_runs_git_status_and_a_test_command_in_one_call(
    sh: PtySession, workspace: Path
) -> None:
    git = await asyncio.create_subprocess_exec("git", "init", "-q", str(workspace))
    assert await git.wait() == 0
    (workspace / "new_file.txt").write_text("x\n")
    result = await sh.batch(
        [
            {"type": "send", "input": "git status --porcelain; echo git-exit=$?\n"},
            {"type": "expect", "pattern": r"git-exit=(\d+)", "timeout_secs": 10},
            SendStep(input="printf 'test result: %s. %d passed\\n' ok 3\n"),
            ExpectStep(pattern=r"test result: ok\. (\d+) passed"),
        ],
        timeout=10,
    )
    data = result.to_dict()
    assert (data["completed"], data["total"]) == (4, 4)
    assert [s["step_type"] for s in data["steps"]] == ["send", "expect", "send", "expect"]
    assert data["steps"][0] == {"index": 0, "step_type": "send", "success": True}
    assert "?? new_file.txt" in data["steps"][1]["output"]
    assert data["steps"][1]["captures"] == ["git-exit=0", "0"]
    assert data["steps"][3]["captures"][1] == "3"


async def test_batch_stops_at_the_first_failing_step_with_partial_results(
    sh: PtySession,
) -> None:
    result = await sh.batch(
        [
            {"type": "send", "input": "echo one\n"},
            {"type": "expect", "pattern": "nothing like this", "timeout_secs": 0.3},
            {"type": "send", "input": "echo never-sent\n"},
        ]
    )
    assert (result.completed, result.total, len(result.steps)) == (1, 3, 2)
    failed = result.to_dict()["steps"][1]
    assert failed["success"] is False and failed["error"].startswith("timeout:")
    assert "one" in failed["output"]


async def test_batch_with_an_invalid_step_sends_nothing(sh: PtySession) -> None:
    with pytest.raises(SandboxError) as info:
        await sh.batch([{"type": "send", "input": "touch oops\n"}, {"type": "expect"}])
    assert info.value.code == ErrorCode.INVALID_INPUT
    with pytest.raises(SandboxError):
        await sh.batch([{"type": "expect_cases", "cases": [{"pattern": "(", "tag": "x"}]}])
    assert sh.read() == ""  # nothing was typed


NO_FOREGROUND_JOB_ON_GVISOR = (
    "gVisor (2022) answers TIOCGPGRP on a terminal's master side with ENOTTY, so the agent "
    "cannot find the foreground job to signal: Ctrl-C and Ctrl-Z from the host reach the shell"
)


async def test_sigint_stops_a_foreground_sleep(sh: PtySession, box_policy: Policy) -> None:
    if box_policy.runtime == "runsc":
        pytest.skip(NO_FOREGROUND_JOB_ON_GVISOR)
    # The program announces itself once it is the terminal's foreground job (the shell hands
    # the terminal over before exec), so the signal cannot reach the shell instead.
    await sh.write("sh -c 'echo rea''dy; exec sleep 60'\n")
    assert (await sh.expect("ready", 10)).matched
    started = time.monotonic()
    assert await sh.signal("SIGINT")
    assert (await sh.expect(PROMPT, 10)).matched
    await sh.write("echo status=$?\n")
    assert (await sh.expect(r"status=(\d+)", 10)).captures[1] == "130"
    assert time.monotonic() - started < 10


async def test_split_utf8_character_is_decoded_whole(sh: PtySession) -> None:
    # Euro sign = e2 82 ac, written in two flushed parts with a pause between them.
    await sh.write(r"printf '\342\202'; sleep 0.2; printf '\254 end\n'" + "\n")
    m = await sh.expect("€ end", 10)
    assert m.matched and "\ufffd" not in m.output


async def test_shell_has_a_real_terminal_with_job_control(
    sh: PtySession, box_policy: Policy
) -> None:
    if box_policy.runtime == "runsc":
        pytest.skip(NO_FOREGROUND_JOB_ON_GVISOR)
    await sh.write('echo "tty=$(tty)"; [ -t 0 ] && [ -t 1 ] && echo isa""tty\n')
    assert (await sh.expect(r"tty=/dev/pts/\d+", 10)).matched
    assert (await sh.expect(r"isatty", 10)).matched
    await sh.write("sh -c 'echo rea''dy; exec sleep 60'\n")
    assert (await sh.expect("ready", 10)).matched
    await sh.signal("SIGTSTP")  # Ctrl-Z: the job stops and the shell takes the terminal back
    assert (await sh.expect(r"Stopped", 10)).matched
    await sh.write("jobs; kill -9 %1; echo kil''led\n")
    assert (await sh.expect("killed", 10)).matched


async def test_resize_changes_the_terminal_size(sandbox: Sandbox) -> None:
    sh = await sandbox.shell(cols=90, rows=30)
    await sh.write("stty size\n")
    assert (await sh.expect(r"(\d+) (\d+)\r\n", 10)).captures[1:] == ["30", "90"]
    await sh.resize(120, 40)
    await sh.write("stty size\n")
    assert (await sh.expect(r"(\d+) (\d+)\r\n", 10)).captures[1:] == ["40", "120"]
    with pytest.raises(SandboxError):
        await sh.resize(0, 10)


async def test_second_concurrent_reader_is_refused(sh: PtySession) -> None:
    first = asyncio.create_task(sh.expect("marker-(\\d)", 10))
    await asyncio.sleep(0)  # let the first expect start waiting (a yield, not a delay)
    with pytest.raises(SessionBusy) as info:
        await sh.expect("anything", 1)
    assert info.value.code == ErrorCode.SESSION_BUSY
    with pytest.raises(SessionBusy):
        sh.read()
    await sh.write("echo marker-$((1+1))\n")
    async with asyncio.timeout(10):
        assert (await first).captures[1] == "2"


async def test_timeout_is_a_result_and_keeps_the_output(sh: PtySession) -> None:
    await sh.write("echo partial\n")
    assert (await sh.expect("partial\r\n", 10)).matched
    await sh.write("echo later\n")
    m = await sh.expect("never printed", 0.3)
    assert (m.matched, m.reason) == (False, "timeout")
    assert m.to_dict()["reason"] == "timeout"
    assert (await sh.expect("later", 10)).matched  # not consumed by the timeout


async def test_shell_exit_is_an_eof_result(sh: PtySession) -> None:
    await sh.write("exit 7\n")
    m = await sh.expect("never printed", 10)
    assert (m.matched, m.reason) == (False, "eof")
    assert sh.exit_code == 7 and sh.closed
    with pytest.raises(SessionNotFound):
        await sh.write("echo hi\n")


async def test_read_returns_what_is_there_without_waiting(sh: PtySession) -> None:
    assert sh.read() == ""
    await sh.write("echo abc-$((40+2))\n")
    assert (await sh.expect("abc-42", 10)).matched
    await sh.write("echo tail-$((1))-end\n")
    assert (await sh.expect("tail-1-end\r\n", 10)).matched
    assert sh.read() in ("", "$ ")  # the next prompt may or may not have arrived yet
    assert sh.read() == ""  # consumed


async def test_strip_ansi_removes_colours(sandbox: Sandbox) -> None:
    sh = await sandbox.shell(strip_ansi=True)
    await sh.write(r"printf '\033[31mred\033[0m-text\n'" + "\n")
    m = await sh.expect(r"red-text\n", 10)
    assert m.matched and "\x1b" not in m.output


async def test_sessions_are_listed_looked_up_and_closed(sandbox: Sandbox) -> None:
    sh = await sandbox.shell(env={"PS1": "box> "})
    assert sandbox.sessions() == [sh] and sandbox.session(sh.session_id) is sh
    assert sh.session_id in repr(sh) and "running" in repr(sh)
    assert (await sh.expect("box> ", 10)).matched
    await sh.close()
    assert sh.closed and sh.exit_code is not None
    assert sandbox.sessions() == []
    with pytest.raises(SessionNotFound):
        sandbox.session(sh.session_id)


async def test_closing_the_sandbox_ends_its_sessions(workspace: Path) -> None:
    async with Sandbox(Policy(), workspace=workspace) as sb:
        sh = await sb.shell()
        waiting = asyncio.create_task(sh.expect("never printed", 30))
        await asyncio.sleep(0)
    async with asyncio.timeout(5):
        m = await waiting
    assert (m.matched, m.reason) == (False, "eof")
    assert sh.closed
