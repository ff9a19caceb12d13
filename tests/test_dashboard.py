"""The web dashboard of ``corral serve`` in a real browser: Debian's chromium, headless,
driven by Playwright (pointed at /usr/bin/chromium; nothing downloaded). A person attaches to
an agent's PTY session, answers the prompt the agent waits on, and the agent's ``expect``
returns. Screenshots land in the test's tmp dir (and in ``artefacts/`` when that exists)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.asyncio.client
import websockets.exceptions
from websockets.typing import Origin

import corral
from corral.server.dashboard import CSP
from served import Served, serving

pytestmark = [pytest.mark.needs_bwrap, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTEFACTS = Path(__file__).resolve().parents[1] / "artefacts"
VENDORED = Path(corral.__file__).parent / "server" / "static" / "vendor" / "xterm.js"
WAIT_MS = 30_000
READ_TOKEN = "read-only-token-for-the-page"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    runtime = tmp_path_factory.mktemp("run")
    with serving(runtime, "--listen", "127.0.0.1:0", "--read-token", READ_TOKEN) as served:
        yield served


def dashboard_url(served: Served) -> str:
    """The URL ``corral serve`` printed, the token in its fragment."""
    for line in served.log:
        found = re.search(r"dashboard at (\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"corral serve printed no dashboard URL: {served.log}")


@contextlib.asynccontextmanager
async def browser_page(shots: Path) -> AsyncIterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("chromium is not installed (make setup installs it)")
    playwright_api = pytest.importorskip("playwright.async_api")
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            context = await browser.new_context(viewport={"width": 1400, "height": 1000})
            page = await context.new_page()
            page.set_default_timeout(WAIT_MS)
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "console",
                lambda msg: problems.append(msg.text) if msg.type == "error" else None,
            )
            page.problems = problems
            yield page
        finally:
            await browser.close()
            if ARTEFACTS.is_dir():
                for shot in shots.glob("*.png"):
                    shutil.copy(shot, ARTEFACTS / shot.name)


async def test_a_person_answers_an_agents_prompt_in_the_browser(
    server: Served, tmp_path: Path
) -> None:
    if not VENDORED.exists():
        pytest.skip("xterm.js is not vendored: make vendor")
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox(labels={"agent": "browser-test"}) as sb,
        browser_page(tmp_path) as page,
    ):
        session = await sb.shell()
        await session.write("read -p 'Continue? ' a; echo got-$a\n")
        assert (await session.expect("Continue\\? $"))["matched"]
        await sb.run("echo audited")

        await page.goto(dashboard_url(server))
        # The token left the address bar (and the history) at once.
        assert "token" not in page.url
        row = page.locator(f"#boxes tr[data-box='{sb.id}']")
        await row.wait_for()
        assert "agent=browser-test" in await row.inner_text()
        await page.locator("#audit").filter(has_text="command").wait_for()
        await row.click()
        await page.screenshot(path=tmp_path / "dashboard-box.png", full_page=True)

        await page.locator(f"#sessions button[data-session='{session.session_id}']").click()
        screen = page.locator("#terminal .xterm-rows")
        await screen.filter(has_text="Continue?").wait_for()  # the person sees the prompt
        await page.locator("#terminal .xterm-helper-textarea").focus()
        await page.keyboard.type("yes")
        await page.keyboard.press("Enter")
        assert (await session.expect("got-yes", timeout=30))["matched"]
        await screen.filter(has_text="got-yes").wait_for()
        await page.screenshot(path=tmp_path / "dashboard-answered.png", full_page=True)

        await page.locator("#detach").click()  # detach: the agent's session goes on
        await session.write("echo after-detach\n")
        assert (await session.expect("after-detach"))["matched"]

        # The agent's tools layer asks a person; the person approves on the page.
        from corral.tools.approvals import ApprovalRequest

        ask = ApprovalRequest("run", "rm -rf build", "deletes files", {"cmd": "rm -rf build"})
        asked = asyncio.ensure_future(remote.approver(box=sb.id)(ask))
        pending = page.locator("#approvals li[data-approval]").filter(has_text="rm -rf build")
        await pending.get_by_role("button", name="Approve").click()
        assert await asyncio.wait_for(asked, 30) is True

        # Attached again, then the tab vanishes without a close: the session still works.
        await page.locator(f"#sessions button[data-session='{session.session_id}']").click()
        await screen.filter(has_text="after-detach").wait_for()
        await page.close()
        await session.write("echo after-vanishing\n")
        assert (await session.expect("after-vanishing"))["matched"]
        assert (await sb.run("echo box-alive")).stdout == "box-alive\n"
        assert page.problems == []


async def test_output_the_server_cut_is_shown_with_a_marker(server: Served, tmp_path: Path) -> None:
    """A process wrote more than the box's output cap: the server keeps the first and last
    halves and says where the middle is missing; the page shows a marker there."""
    policy = corral.Policy.from_dict({"limits": {"output_bytes": "64K"}})
    written = b"".join(b"%d\n" % n for n in range(1, 100_001))
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox(policy) as sb,
        browser_page(tmp_path) as page,
    ):
        proc = await sb.spawn(["seq", "1", "100000"])
        assert (await proc.wait(timeout=60)).exit_code == 0
        headers = {"Authorization": f"Bearer {server.token}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as client:
            path = f"/v1/boxes/{sb.id}/processes/{proc.pid}/output"
            cut = await client.get(path, params={"stream": "stdout"})
            whole = await client.get(path, params={"stream": "stderr"})
        assert cut.headers["x-corral-cut-at"] == str(32 << 10)
        assert cut.headers["x-corral-cut-bytes"] == str(len(written) - (64 << 10))
        assert "x-corral-cut-at" not in whole.headers  # stderr is whole

        await page.goto(dashboard_url(server))
        await page.locator(f"#boxes tr[data-box='{sb.id}']").click()
        await page.locator(f"#processes tr[data-pid='{proc.pid}']").click()
        marker = f"[... {len(written) - (64 << 10)} bytes truncated"
        await page.locator("#output").filter(has_text=marker).wait_for()
        shown = await page.locator("#output").text_content()
        assert shown is not None
        head, _, tail = shown.partition(marker)
        assert written.decode().startswith(head.removesuffix("\n"))
        assert written.decode().endswith(tail.split("]\n", 1)[1])
        await page.screenshot(path=tmp_path / "dashboard-output-cut.png", full_page=True)
        assert page.problems == []


async def test_the_page_loads_no_data_without_a_token(server: Served, tmp_path: Path) -> None:
    async with browser_page(tmp_path) as page:
        asked: list[str] = []
        page.on("request", lambda request: asked.append(request.url))
        await page.goto(server.url + "/")
        await page.locator("#status.error").filter(has_text="no token").wait_for()
        await page.screenshot(path=tmp_path / "dashboard-no-token.png")
        assert not [url for url in asked if "/v1/" in url]
        # A wrong token (pasted into the same tab): the server's refusal is shown, no box is.
        await page.goto(server.url + "/#token=not-the-token")
        await page.locator("#status.error").filter(has_text="unauthorized").wait_for()
        assert await page.locator("#boxes tr[data-box]").count() == 0
        assert "token" not in page.url


async def test_an_ended_session_is_marked_with_no_attach(server: Served, tmp_path: Path) -> None:
    """A session whose shell exited stays in the box's list; the page marks it ended, with
    its exit status, and offers no Attach for it (a live one keeps its button)."""
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox() as sb,
        browser_page(tmp_path) as page,
    ):
        live, ended = await sb.shell(), await sb.shell()
        await ended.write("exit 7\n")
        assert (await ended.expect("never-printed", timeout=30))["reason"] == "eof"
        await page.goto(dashboard_url(server))
        await page.locator(f"#boxes tr[data-box='{sb.id}']").click()
        item = page.locator(f"#sessions li[data-session='{ended.session_id}']")
        await item.filter(has_text="ended (exit 7)").wait_for()
        assert await item.locator("button").count() == 0
        attach = page.locator(f"#sessions button[data-session='{live.session_id}']")
        assert await attach.is_enabled()
        assert page.problems == []


async def test_a_box_closed_under_an_open_terminal_is_told(server: Served, tmp_path: Path) -> None:
    """The agent closes its box while a person has its terminal open: the pane goes, and the
    page says the box was closed (it vanished with no word)."""
    if not VENDORED.exists():
        pytest.skip("xterm.js is not vendored: make vendor")
    async with (
        corral.connect(server.url, server.token) as remote,
        browser_page(tmp_path) as page,
    ):
        sb = remote.Sandbox()
        await sb.start()
        try:
            session = await sb.shell()
            await session.write("echo ready-$((6*7))\n")
            assert (await session.expect("ready-42"))["matched"]
            await page.goto(dashboard_url(server))
            await page.locator(f"#boxes tr[data-box='{sb.id}']").click()
            await page.locator(f"#sessions button[data-session='{session.session_id}']").click()
            await page.locator("#terminal .xterm-rows").filter(has_text="ready-42").wait_for()
        finally:
            await sb.aclose()
        await page.locator("#notice").filter(has_text=f"box {sb.id} was closed").wait_for()
        assert "terminal was detached" in await page.locator("#notice").inner_text()
        assert await page.locator("#box-section").is_hidden()
        await page.screenshot(path=tmp_path / "dashboard-box-closed.png", full_page=True)
        assert page.problems == []


async def test_a_read_only_token_is_offered_no_attach(server: Served, tmp_path: Path) -> None:
    """The page asks the server what its token may do: with a read-only one it offers no
    Attach (nor Approve), and an attach the server refuses says why."""
    if not VENDORED.exists():
        pytest.skip("xterm.js is not vendored: make vendor")
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox() as sb,
        browser_page(tmp_path) as page,
    ):
        session = await sb.shell()
        for token, scope in ((READ_TOKEN, "read"), (server.token, "operate")):
            headers = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=server.url, headers=headers) as client:
                assert (await client.get("/v1/info")).json()["scope"] == scope
        await page.goto(f"{server.url}/#token={READ_TOKEN}")
        await page.locator(f"#boxes tr[data-box='{sb.id}']").click()
        button = page.locator(f"#sessions button[data-session='{session.session_id}']")
        await button.wait_for()
        assert await button.is_disabled()
        assert "read-only" in (await page.locator("#sessions").inner_text())
        # A stale button (or a hand-made call) is refused by the server: the page says why.
        await page.evaluate("([box, sid]) => attach(box, sid)", [sb.id, session.session_id])
        await page.locator("#terminal .xterm-rows").filter(has_text="read-only").wait_for()
        await page.locator("#status.error").filter(has_text="read-only").wait_for()
        await page.screenshot(path=tmp_path / "dashboard-read-only.png", full_page=True)
        refused = [p for p in page.problems if "WebSocket connection" not in p]
        assert refused == []


async def test_a_malformed_token_in_the_address_is_told(server: Served, tmp_path: Path) -> None:
    """A token pasted cut short (``%E0%A4%A`` is no valid escape): the page says so, asks for
    nothing and throws nothing; the whole URL pasted into the same tab then works."""
    async with browser_page(tmp_path) as page:
        asked: list[str] = []
        page.on("request", lambda request: asked.append(request.url))
        await page.goto(server.url + "/#token=%E0%A4%A")
        await page.locator("#status.error").filter(has_text="malformed").wait_for()
        await page.screenshot(path=tmp_path / "dashboard-malformed-token.png")
        assert not [url for url in asked if "/v1/" in url]
        assert "token" not in page.url
        assert page.problems == []
        await page.goto(dashboard_url(server))
        await page.locator("#status").filter(has_text="updated").wait_for()


def test_the_page_is_served_with_a_strict_csp(server: Served) -> None:
    with httpx.Client(base_url=server.url) as client:
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["content-security-policy"] == CSP
        assert "script-src 'self';" in CSP
        assert "unsafe-eval" not in CSP
        assert "<script>" not in page.text  # no inline script: the CSP would refuse it
        assert client.get("/static/dashboard.js").status_code == 200
        missing = client.get("/static/../api.py")
        assert missing.status_code in (401, 404)
        assert client.get("/static/nothing.js").json()["error"]["code"] == "file_not_found"
        # The data is not open: the page is.
        assert client.get("/v1/boxes").status_code == 401


async def test_a_websocket_from_another_origin_is_refused(server: Served) -> None:
    assert server.token is not None
    async with corral.connect(server.url, server.token) as remote, remote.Sandbox() as sb:
        session = await sb.shell()
        path = f"/v1/boxes/{sb.id}/sessions/{session.session_id}/attach?token={server.token}"
        url = server.url.replace("http://", "ws://") + path
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.asyncio.client.connect(url, origin=Origin("http://evil.example")):
                pass
        assert refused.value.response.status_code == 403
        # The page's own origin is let in.
        own = server.url
        async with websockets.asyncio.client.connect(url, origin=Origin(own)) as ws:
            await ws.send(b"echo same-origin\r")
            assert (await session.expect("same-origin"))["matched"]


async def test_a_terminal_gives_the_agent_its_size_back_when_it_detaches(server: Served) -> None:
    """The page's terminal resizes the agent's PTY to its own; once the last person has left,
    the agent's program sees the size it had again (as after ``corral attach``)."""
    assert server.token is not None
    headers = {"Authorization": f"Bearer {server.token}"}
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox() as sb,
        httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client,
    ):
        session = await sb.shell(cols=132, rows=40)
        await session.write("stty size\n")
        assert (await session.expect("40 132"))["matched"]
        path = f"/v1/boxes/{sb.id}/sessions/{session.session_id}/attach?token={server.token}"
        url = server.url.replace("http://", "ws://") + path
        async with websockets.asyncio.client.connect(url, origin=Origin(server.url)) as ws:
            await ws.send(json.dumps({"resize": [100, 24]}))
            await ws.send(b"stty size\r")  # after the resize: one socket, in order
            assert (await session.expect("24 100"))["matched"]
        sessions = f"/v1/boxes/{sb.id}/sessions"
        async with asyncio.timeout(30):  # the server notices the close: nobody attached
            while (await client.get(sessions)).json()[0]["attached"]:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await session.write("stty size; echo size-$((1+1))\n")
        after = await session.expect(r"(\d+ \d+)\r?\nsize-2")
        assert after["captures"][1] == "40 132"


async def test_the_audit_stream_is_live(server: Served) -> None:
    assert server.token is not None
    headers = {"Authorization": f"Bearer {server.token}"}
    async with (
        corral.connect(server.url, server.token) as remote,
        remote.Sandbox() as sb,
        httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client,
        client.stream("GET", "/v1/audit", params={"history": "false", "box": sb.id}) as stream,
    ):
        assert stream.headers["content-type"].startswith("text/event-stream")
        await sb.run("echo audited-live")
        async with asyncio.timeout(30):
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    record = json.loads(line[6:])
                    assert record["box"] == sb.id
                    if record["kind"] == "command":
                        break
        assert "echo audited-live" in json.dumps(record)


async def test_an_agents_approval_request_is_answered_by_a_person(server: Served) -> None:
    from corral.tools.approvals import ApprovalRequest

    assert server.token is not None
    headers = {"Authorization": f"Bearer {server.token}"}
    request = ApprovalRequest("run", "git push", "pushes to a remote", {"cmd": "git push"})
    async with (
        corral.connect(server.url, server.token) as remote,
        httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as person,
    ):
        for approve in (True, False):
            asked = asyncio.ensure_future(remote.approver(box="box-x")(request))
            async with asyncio.timeout(30):
                # The list is polled over HTTP, as the dashboard does: no event crosses it.
                while not (pending := (await person.get("/v1/approvals")).json()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert pending[0]["command_line"] == "git push"
            assert pending[0]["box"] == "box-x"
            answer = await person.post(
                f"/v1/approvals/{pending[0]['id']}", json={"approve": approve}
            )
            assert answer.status_code == 200
            assert await asyncio.wait_for(asked, 30) is approve
            assert (await person.get("/v1/approvals")).json() == []
        # Nobody answers: denied at the timeout; answering afterwards is refused.
        assert await remote.approver(timeout=0.2)(request) is False
        late = await person.post("/v1/approvals/appr-gone", json={"approve": True})
        assert late.json()["error"]["code"] == "invalid_input"


async def test_a_request_whose_asker_left_is_withdrawn(server: Served) -> None:
    """The agent that asked goes away (its request ends): the request leaves the list at
    once, not at its timeout, and a person's answer to it is refused, not taken as received."""
    assert server.token is not None
    headers = {"Authorization": f"Bearer {server.token}"}
    ask = {"tool": "run_command", "command_line": "rm -rf /", "timeout_secs": 600}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as person:
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=700) as agent:
            asking = asyncio.ensure_future(agent.post("/v1/approvals", json=ask))
            async with asyncio.timeout(30):
                while not (pending := (await person.get("/v1/approvals")).json()):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asking
        # The agent's connection is closed: the server notices, the request is withdrawn.
        async with asyncio.timeout(30):
            while (await person.get("/v1/approvals")).json():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        answer = await person.post(f"/v1/approvals/{pending[0]['id']}", json={"approve": True})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "invalid_input"
        assert "withdrawn" in error["message"]
        # One that was never asked says so too.
        unknown = await person.post("/v1/approvals/appr-never", json={"approve": True})
        assert "no such request" in unknown.json()["error"]["message"]


async def test_an_audit_stream_is_subscribed_before_its_response_starts() -> None:
    """GET /v1/audit takes its reader before the response's headers go out, so a record
    published between the headers and the body's first read reaches it; a reader whose
    response never started (its client left first) is dropped with its generator."""
    import gc

    from corral.server.feed import AuditFeed

    feed = AuditFeed()
    feed.bind()
    kept, queue = feed.open_reader()
    assert kept == []
    feed.publish({"kind": "command", "event": "start"})
    assert queue.get_nowait() == {"kind": "command", "event": "start"}
    del queue
    gc.collect()
    assert len(feed._readers) == 0


async def test_the_audit_feed_keeps_the_order_records_came_in() -> None:
    """A record another thread published reaches readers before one the loop's thread
    published after it (the thread's goes through the loop)."""
    import threading

    from corral.server.feed import AuditFeed

    feed = AuditFeed()
    feed.bind()
    _, queue = feed.open_reader()
    sender = threading.Thread(target=feed.publish, args=({"n": 1},))
    sender.start()
    sender.join()
    feed.publish({"n": 2})
    async with asyncio.timeout(10):
        got = [await queue.get(), await queue.get()]
    assert got == [{"n": 1}, {"n": 2}]
    assert [r["n"] for r in feed.recent] == [1, 2]
