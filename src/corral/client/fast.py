"""The CLI's way to a running ``corral serve``: stdlib only (``http.client`` over a unix
socket or TCP), so a ``corral run`` through the server imports nothing heavy.

Where the server is: ``$CORRAL_HOST`` (``unix:/path/serve.sock`` or ``http://HOST:PORT``;
``local`` means never use a server), else the default socket
(``$XDG_RUNTIME_DIR/corral/serve.sock``, or ``/tmp/corral-UID/serve.sock``) when it exists.
The token: ``$CORRAL_TOKEN``, else the token file ``corral serve`` wrote for that address.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = [
    "Conn",
    "ServerError",
    "default_socket",
    "locate",
    "runtime_base",
    "token_file_name",
]


class ServerError(Exception):
    """An error the server answered with (its stable code and sentence)."""

    def __init__(self, code: str, message: str, status: int = 0, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retryable = retryable


def runtime_base() -> str:
    """Where corral keeps a user's sockets and token files (see ``transport.runtime_dir``)."""
    uid = os.getuid()
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    if os.path.isdir(base):
        return os.path.join(base, "corral")
    return os.path.join(tempfile.gettempdir(), f"corral-{uid}")


def default_socket() -> str:
    return os.path.join(runtime_base(), "serve.sock")


def token_file_name(host: str, port: int, scope: str = "operate") -> str:
    return f"serve-{host}-{port}{'' if scope == 'operate' else '-' + scope}.token"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Conn:
    """One server address; each request is a new connection (the CLI makes few)."""

    def __init__(self, target: str, token: str | None = None, timeout: float | None = None):
        self.target = target
        self.timeout = timeout
        if target.startswith("unix:"):
            self.unix: str | None = target[5:]
            self.host, self.port = "localhost", 0
        else:
            parts = urlsplit(target if "://" in target else f"http://{target}")
            if parts.scheme != "http" or not parts.hostname:
                raise ServerError(
                    "invalid_input",
                    f"CORRAL_HOST={target!r}: give unix:/path/to/serve.sock or http://HOST:PORT",
                )
            self.unix = None
            self.host, self.port = parts.hostname, parts.port or 7420
        self.token = token if token is not None else self._token()

    def _token(self) -> str | None:
        env = os.environ.get("CORRAL_TOKEN")
        if env:
            return env
        if self.unix is not None:
            return None
        path = os.path.join(runtime_base(), token_file_name(self.host, self.port))
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _connection(self) -> http.client.HTTPConnection:
        if self.unix is not None:
            return _UnixConnection(self.unix, self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        raw: bytes | Iterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        """Send a request; a JSON ``body`` or a ``raw`` byte body (an iterable is sent
        chunked as it is produced). An error status raises :class:`ServerError`."""
        head = {"Host": self._host_header()}
        if self.token:
            head["Authorization"] = f"Bearer {self.token}"
        data: Any = None
        if body is not None:
            data = json.dumps(body).encode()
            head["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            head["Content-Type"] = "application/octet-stream"
        head.update(headers or {})
        conn = self._connection()
        try:
            encode_chunked = data is not None and not isinstance(data, bytes | bytearray)
            conn.request(method, path, body=data, headers=head, encode_chunked=encode_chunked)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ServerError(
                "server_unavailable",
                f"corral serve at {self.target} did not answer ({exc}); start it with "
                "`corral serve`, or set CORRAL_HOST=local to run without it",
                retryable=True,
            ) from None
        if response.status >= 400:
            raise _error(response)
        return response

    def json(self, method: str, path: str, body: Any = None) -> Any:
        response = self.request(method, path, body=body)
        data = response.read()
        return json.loads(data) if data else None

    def _host_header(self) -> str:
        if self.unix is not None:
            return "localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _error(response: http.client.HTTPResponse) -> ServerError:
    data = response.read()
    try:
        err = json.loads(data)["error"]
        return ServerError(
            str(err["code"]), str(err["message"]), response.status, bool(err.get("retryable"))
        )
    except (ValueError, KeyError, TypeError):
        text = data.decode("utf-8", "replace")[:200]
        return ServerError("server_error", f"HTTP {response.status}: {text}", response.status)


def locate() -> Conn | None:
    """The server the CLI should use, or None to run in-process."""
    target = os.environ.get("CORRAL_HOST", "").strip()
    if target == "local":
        return None
    if target:
        return Conn(target)
    path = default_socket()
    try:
        st = os.stat(path)
    except OSError:
        return None
    import stat as _stat

    if not _stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return None
    return Conn(f"unix:{path}")


def q(value: str) -> str:
    return quote(value, safe="")


def chunks(fd: int, size: int = 1 << 16) -> Iterator[bytes]:
    """``fd``'s bytes as they come, until EOF."""
    while True:
        data = os.read(fd, size)
        if not data:
            return
        yield data
