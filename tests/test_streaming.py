"""Streaming exec in real sandboxes: events as they happen, stdin pipe, tty, timeouts."""

from __future__ import annotations

import asyncio
import os

import pytest

from corral import Sandbox
from corral.errors import ErrorCode, SandboxError
from corral.streaming import ExecEvent, ExecStream, Exited, Stderr, Stdout

pytestmark = pytest.mark.needs_bwrap


async def collect(stream: ExecStream) -> list[ExecEvent]:
    return [event async for event in stream]


def joined(events: list[ExecEvent], kind: type[Stdout] | type[Stderr]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, kind))


async def test_events_are_stdout_stderr_then_exit(sandbox: Sandbox) -> None:
    events = await collect(await sandbox.exec_stream("echo out; echo err >&2; exit 3"))
    assert joined(events, Stdout) == b"out\n" and joined(events, Stderr) == b"err\n"
    assert events[-1] == Exited(3)
    assert sum(isinstance(e, Exited) for e in events) == 1


async def test_output_arrives_while_the_command_runs(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream(
        ["sh", "-c", "echo first; read x; echo second $x"], stdin="pipe"
    )
    async with stream:
        first = await anext(stream)
        assert first == Stdout(b"first\n")  # before the command could finish
        await stream.write(b"go\n")
        rest = await collect(stream)
    assert joined(rest, Stdout) == b"second go\n" and rest[-1] == Exited(0)


async def test_stdin_pipe_writer_and_close(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream(["tr", "a-z", "A-Z"], stdin="pipe")
    assert stream.stdin is stream
    await stream.write("hello ")
    await stream.write(b"world\n")
    await stream.close_stdin()
    events = await collect(stream)
    assert joined(events, Stdout) == b"HELLO WORLD\n" and events[-1] == Exited(0)


async def test_tty_output_comes_as_stdout_and_stdin_works(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream(
        ["sh", "-c", "[ -t 1 ] && echo on-a-tty; read x; echo got-$x"], tty=True
    )
    await stream.write(b"hi\n")
    events = await collect(stream)
    out = joined(events, Stdout)
    assert b"on-a-tty" in out and b"got-hi" in out
    assert not any(isinstance(e, Stderr) for e in events) and events[-1] == Exited(0)


async def test_timeout_ends_the_command_with_term_first(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream("sleep 60", timeout=0.3)
    events = await collect(stream)
    assert stream.timed_out and events == [Exited(-15)]
    assert stream.process.ended == "timed_out"


async def test_wait_returns_the_status_and_large_output_is_complete(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream("seq 1 20000")
    events = await collect(stream)
    assert joined(events, Stdout) == b"".join(b"%d\n" % i for i in range(1, 20001))
    assert await stream.wait() == 0


async def test_leaving_the_context_ends_a_running_command(sandbox: Sandbox) -> None:
    async with await sandbox.exec_stream("sleep 60") as stream:
        pass
    assert stream.exit_code == -15  # SIGTERM first (tests/test_process_lifecycle.py: the KILL)


async def test_writing_without_stdin_is_refused(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream("true")
    assert stream.stdin is None
    with pytest.raises(SandboxError) as info:
        await stream.write(b"x")
    assert info.value.code == ErrorCode.INVALID_INPUT
    assert await stream.wait(10) == 0


async def test_iterating_the_call_directly_starts_and_streams(sandbox: Sandbox) -> None:
    events = [ev async for ev in sandbox.exec_stream("echo out; echo err >&2; exit 3")]
    assert joined(events, Stdout) == b"out\n" and joined(events, Stderr) == b"err\n"
    assert events[-1] == Exited(3)


async def test_the_call_is_also_a_context_manager(sandbox: Sandbox) -> None:
    async with sandbox.exec_stream("echo up; sleep 60") as stream:
        assert await anext(stream) == Stdout(b"up\n")
    assert stream.exit_code == -15  # left running: ended (SIGTERM) on the way out


async def test_the_command_starts_once_and_only_when_used(sandbox: Sandbox) -> None:
    pending = sandbox.exec_stream(["echo", "once"])
    assert sandbox.processes() == []  # nothing runs until the stream is used
    stream = await pending
    assert await pending is stream
    assert [p.pid for p in sandbox.processes()] == [stream.pid]
    assert await collect(stream) == [Stdout(b"once\n"), Exited(0)]


async def test_an_empty_command_is_refused_at_the_call(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxError) as info:
        sandbox.exec_stream("  ")
    assert info.value.code == ErrorCode.INVALID_INPUT


async def test_heavy_output_comes_in_large_chunks_byte_exact(sandbox: Sandbox) -> None:
    """A pipe a read found full is enlarged (1 MiB) and read 1 MiB at a time by the agent:
    fewer, larger frames, the same bytes in order (issue 14: streaming at pipe speed)."""
    code = "import sys; sys.stdout.buffer.write(bytes(range(256)) * 32768)"  # 8 MiB at once
    events = await collect(await sandbox.exec_stream(["python3", "-c", code]))
    same = await asyncio.to_thread(lambda: joined(events, Stdout) == bytes(range(256)) * 32768)
    assert same
    assert max(len(e.data) for e in events if isinstance(e, Stdout)) > 65536


async def test_a_stream_nobody_reads_holds_its_command_not_the_host(sandbox: Sandbox) -> None:
    size = 48 << 20  # far more than a held stream lets through (4 MiB, a pipe, the channel)
    command = f"head -c {size} /dev/zero; touch /tmp/all-written"
    async with sandbox.exec_stream(command) as stream:
        async with asyncio.timeout(30):
            while not stream.process.output_held:  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.02)  # no event says "the box stopped reading"
        # Held: the command blocks on its pipe instead of the host queueing all 48 MiB.
        assert (await sandbox.run("test -e /tmp/all-written")).exit_code == 1
        events = await collect(stream)  # a reader again: it is released and runs to the end
    assert sum(len(e.data) for e in events if isinstance(e, Stdout)) == size
    assert events[-1] == Exited(0)
    assert not stream.process.output_held
    assert (await sandbox.run("test -e /tmp/all-written")).exit_code == 0


async def test_leaving_an_async_for_early_ends_the_command(sandbox: Sandbox) -> None:
    script = "trap 'echo term > /tmp/ended; exit 0' TERM; echo up; while :; do sleep 0.1; done"
    async for event in sandbox.exec_stream(script):
        assert event == Stdout(b"up\n")
        break
    (pid,) = [p.pid for p in sandbox.processes() if "trap" in p.command]
    assert (
        await sandbox.process(pid).wait(10)
    ).status == "exited"  # ended by the loop's exit, on its TERM
    assert (await sandbox.run("cat /tmp/ended")).stdout == "term\n"


async def test_the_call_tells_whether_its_timeout_ended_the_command(sandbox: Sandbox) -> None:
    pending = sandbox.exec_stream("sleep 60", timeout=0.3)
    events = [event async for event in pending]
    assert pending.timed_out and events == [Exited(-15)]


async def test_waiting_on_a_stream_that_was_never_read_is_not_held(sandbox: Sandbox) -> None:
    stream = await sandbox.exec_stream(f"head -c {24 << 20} /dev/zero")
    assert await stream.wait(60) == 0  # its unread output is dropped, never holding it


async def test_piped_stdin_written_while_the_output_is_read(sandbox: Sandbox) -> None:
    # The agent closed the command's stdin in one event of a batch and then met that fd's
    # stale "writable" event in the same batch: it died, the command with it (1 in ~10).
    data = os.urandom(70_000)
    for _ in range(30):
        stream = await sandbox.exec_stream(["wc", "-c"], stdin="pipe")

        async def feed(stream: ExecStream = stream) -> None:
            await stream.write(data)
            await stream.close_stdin()

        fed = asyncio.ensure_future(feed())
        events = await collect(stream)
        await fed
        assert events == [Stdout(b"70000\n"), Exited(0)]
