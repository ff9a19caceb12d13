"""A scripted stand-in for an OpenAI-compatible chat API on 127.0.0.1 (for the docs' agent loop).

It plays a model that makes one tool call and then answers. The first request of a
conversation gets a ``run_command`` call of ``python3 --version``; once the tool's result is
among the messages, the answer quotes its stdout. A request without the ``run_command`` tool,
or a tool result that is an error, gets HTTP 400, so the client (and the doc test) fails
loudly. Nothing leaves the machine; the API key is not checked.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "run_command", "arguments": json.dumps({"command": "python3 --version"})},
}


def reply(request: dict[str, Any]) -> dict[str, Any]:
    """The completion for one chat request, or raise ValueError saying what is wrong with it."""
    names = {t.get("function", {}).get("name") for t in request.get("tools", [])}
    if "run_command" not in names:
        raise ValueError(f"no run_command among the tools offered: {sorted(map(str, names))}")
    results = [m for m in request.get("messages", []) if m.get("role") == "tool"]
    if not results:
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
        finish = "tool_calls"
    else:
        result = json.loads(results[-1]["content"])
        if "error" in result or result.get("exit_code") != 0:
            raise ValueError(f"the tool call failed: {result}")
        message = {"role": "assistant", "content": f"The sandbox has {result['stdout'].strip()}."}
        finish = "stop"
    return {
        "id": "chatcmpl-doc-test",
        "object": "chat.completion",
        "created": 0,
        "model": request.get("model", "scripted"),
        "choices": [{"index": 0, "finish_reason": finish, "message": message}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        try:
            if not self.path.endswith("/chat/completions"):
                raise ValueError(f"unexpected path {self.path}")
            body, status = reply(json.loads(self.rfile.read(length))), 200
        except ValueError as exc:
            body, status = {"error": {"message": str(exc), "type": "invalid_request_error"}}, 400
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class ScriptedModel:
    """``with ScriptedModel() as model:`` serves ``model.base_url`` until the block ends."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ScriptedModel:
        self.thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
