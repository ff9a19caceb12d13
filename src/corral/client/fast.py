"""The CLI's way to a running ``corral serve``: stdlib only (plain sockets, a unix socket
or TCP), so a ``corral run`` through the server imports nothing heavy.

Where the server is: ``$CORRAL_HOST`` (``unix:/path/serve.sock`` or ``http://HOST:PORT``;
``local`` means never use a server), else the default socket
(``$XDG_RUNTIME_DIR/corral/serve.sock``, or ``/tmp/corral-UID/serve.sock``) when it exists.
The token: ``$CORRAL_TOKEN``, else the token file ``corral serve`` wrote for that address.
"""

from __future__ import annotations

# The C halves of socket and json: their Python layers import enum, selectors, re and more,
# about 15 ms of CPU of a `corral run` through the server here (its whole client side took
# ~35 ms). _socket.socket has every method used below; lean's dumps/loads are json's own C
# encoder and scanner (ASCII-only output, compact separators).
import _socket
import os

from corral.agent import lean

TYPE_CHECKING = False  # typing costs the CLI's start more than it gives here
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from typing import Any

__all__ = [
    "Conn",
    "Response",
    "ServerError",
    "default_socket",
    "locate",
    "runtime_base",
    "token_file_name",
]

# A small HTTP/1.1 client of our own: http.client (with the email and ssl modules it
# imports) alone cost about 40 ms of the CLI's start, a third of what `corral run` through
# the server may take. One request per connection (Connection: close), bodies by length or
# chunked: what corral serve sends and nothing more.
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


class ServerError(Exception):
    """An error the server answered with (its stable code and sentence)."""

    def __init__(self, code: str, message: str, status: int = 0, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.retryable = retryable


class Response:
    """A response read off its socket: ``status``, ``headers`` and ``read(n)``."""

    def __init__(self, sock: _socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._eof = False
        head = self._line()
        parts = head.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise OSError(f"not an HTTP response: {head[:80]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        while line := self._line():
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._left: int | None = None if self._chunked or length is None else int(length)
        self._chunk_left = 0
        self._done = self._left == 0

    def _fill(self) -> bool:
        if self._eof:
            return False
        data = self._sock.recv(1 << 16)
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def _line(self, where: str = "in its head") -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > 1 << 16 or not self._fill():
                raise OSError(f"the server's response ended {where}")
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _take(self, n: int) -> bytes:
        if not self._buf:
            self._fill()
        data = bytes(self._buf[:n])
        del self._buf[: len(data)]
        return data

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes of the body (all of it for -1); b"" at its end."""
        if n < 0:
            parts = []
            while piece := self.read(1 << 20):
                parts.append(piece)
            return b"".join(parts)
        if self._done or n == 0:
            return b""
        if self._chunked:
            if self._chunk_left == 0:
                # Lines of the body too: a server gone mid-stream is not said as a cut head.
                size = int(self._line("mid-stream").split(b";")[0], 16)
                if size == 0:
                    while self._line("mid-stream"):  # trailers
                        pass
                    self._done = True
                    return b""
                self._chunk_left = size
            data = self._take(min(n, self._chunk_left))
            if not data:
                raise OSError("the server's response ended mid-chunk")
            self._chunk_left -= len(data)
            if self._chunk_left == 0:
                self._line("mid-stream")
            return data
        want = n if self._left is None else min(n, self._left)
        data = self._take(want)
        if self._left is not None:
            if not data:
                raise OSError("the server's response ended early")
            self._left -= len(data)
            self._done = self._left == 0
        elif not data:
            self._done = True
        return data

    def close(self) -> None:
        self._sock.close()


def runtime_base() -> str:
    """Where corral keeps a user's sockets and token files (see ``transport.runtime_dir``)."""
    uid = os.getuid()
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    if os.path.isdir(base):
        return os.path.join(base, "corral")
    return os.path.join(_tempdir(), f"corral-{uid}")


def _tempdir() -> str:
    """``tempfile.gettempdir()``'s usual answer, without importing tempfile."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.isdir(value):
            return value
    return "/tmp"


def default_socket() -> str:
    return os.path.join(runtime_base(), "serve.sock")


def token_file_name(host: str, port: int, scope: str = "operate") -> str:
    """The token file of a server on ``host:port``; ``localhost`` is named as 127.0.0.1,
    so a client and a server that spell the address differently still meet."""
    host = "127.0.0.1" if host.lower() == "localhost" else host
    return f"serve-{host}-{port}{'' if scope == 'operate' else '-' + scope}.token"


class Conn:
    """One server address; each request is a new connection (the CLI makes few)."""

    def __init__(self, target: str, token: str | None = None, timeout: float | None = None):
        self.target = target
        self.timeout = timeout
        if target.startswith("unix:"):
            self.unix: str | None = target[5:]
            self.host, self.port = "localhost", 0
        else:
            self.unix = None
            self.host, self.port = _host_port(target)
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

    def _connect(self) -> _socket.socket:
        if self.unix is not None:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            address: Any = self.unix
        else:
            family = _socket.AF_INET6 if ":" in self.host else _socket.AF_INET
            sock = _socket.socket(family, _socket.SOCK_STREAM)
            address = (self.host, self.port)
        sock.settimeout(self.timeout)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        return sock

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        raw: bytes | Iterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Send a request; a JSON ``body`` or a ``raw`` byte body (an iterable is sent
        chunked as it is produced). An error status raises :class:`ServerError`."""
        head = {"Host": self._host_header(), "Connection": "close"}
        if self.token:
            head["Authorization"] = f"Bearer {self.token}"
        data: bytes | Iterable[bytes] | None = None
        if body is not None:
            data = lean.dumps(body).encode()
            head["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            head["Content-Type"] = "application/octet-stream"
        if isinstance(data, bytes | bytearray):
            head["Content-Length"] = str(len(data))
        elif data is not None:
            head["Transfer-Encoding"] = "chunked"
        else:
            head["Content-Length"] = "0"
        head.update(headers or {})
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
        try:
            sock = self._connect()
        except OSError as exc:
            raise ServerError(
                "server_unavailable",
                f"corral serve at {self.target} did not answer ({exc.strerror or exc}); start "
                "it with `corral serve`, or set CORRAL_HOST=local to run without it",
                retryable=True,
            ) from None
        try:
            sock.sendall("\r\n".join(lines).encode("latin-1"))
            if isinstance(data, bytes | bytearray):
                sock.sendall(data)
            elif data is not None:
                for chunk in data:
                    if chunk:
                        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sock.sendall(b"0\r\n\r\n")
            response = Response(sock)
        except OSError as exc:
            answer = _answer_anyway(sock)
            if answer is None:
                sock.close()
                raise self._broke_off(exc) from None
            response = answer
        if response.status >= 400:
            raise _error(response)
        return response

    def json(self, method: str, path: str, body: Any = None) -> Any:
        response = self.request(method, path, body=body)
        data = response.read()
        return lean.loads(data) if data else None

    def _broke_off(self, exc: OSError) -> ServerError:
        owner = None
        if self.unix is not None:
            try:
                owner = os.stat(self.unix).st_uid
            except OSError:
                pass
        if owner is not None and owner != os.getuid():
            return ServerError(
                "unauthorized",
                f"corral serve at {self.target} serves its owner only (uid {owner}, not "
                f"{os.getuid()}): start a server of your own, or use one on TCP with a token",
                200,
            )
        return ServerError(
            "server_unavailable",
            f"corral serve at {self.target} broke off the request ({exc})",
            200,
            retryable=True,
        )

    def _host_header(self) -> str:
        if self.unix is not None:
            return "localhost"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


ANSWER_TIMEOUT = 10.0
"""How long a request whose sending broke waits for the answer the server may have sent."""


def _answer_anyway(sock: _socket.socket) -> Response | None:
    """The response the server sent before it stopped reading the request, or None.

    A server refuses a request while its body is still coming (stdin over its cap, a copy
    to a path the policy refuses) by answering and closing: sending the rest then breaks
    (EPIPE, ECONNRESET), but the answer is already here to read. Said as the server's own
    error (``request_too_large``), not as the server failing, which a caller retries.
    """
    try:
        sock.settimeout(ANSWER_TIMEOUT)
        return Response(sock)
    except OSError:
        return None


def _error(response: Response) -> ServerError:
    data = response.read()
    response.close()
    try:
        err = lean.loads(data)["error"]
        return ServerError(
            str(err["code"]), str(err["message"]), response.status, bool(err.get("retryable"))
        )
    except (ValueError, KeyError, TypeError):
        text = data.decode("utf-8", "replace")[:200]
        return ServerError("server_error", f"HTTP {response.status}: {text}", response.status)


def _host_port(target: str) -> tuple[str, int]:
    """``http://HOST:PORT`` (or ``HOST:PORT``; ``[v6]:PORT``) -> host and port."""
    bad = ServerError(
        "invalid_input",
        f"CORRAL_HOST={target!r}: give unix:/path/to/serve.sock or http://HOST:PORT",
    )
    if "://" in target and not target.startswith("http://"):
        raise bad
    hostport = target.removeprefix("http://").split("/", 1)[0]
    if hostport.startswith("["):
        host, _, port = hostport[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, ""
    port = port or "7420"
    if not host or not port.isdigit() or int(port) > 65535:
        raise bad
    return host, int(port)


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
    if st.st_mode & 0o170000 != 0o140000 or st.st_uid != os.getuid():  # a socket of ours
        return None
    return Conn(f"unix:{path}")


def q(value: str) -> str:
    """``urllib.parse.quote(os.fsencode(value), safe="")``, without importing urllib: a name
    that is not UTF-8 goes as its bytes (the server reads it back so, ``api._exact``)."""
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in os.fsencode(value))


def chunks(fd: int, size: int = 1 << 16) -> Iterator[bytes]:
    """``fd``'s bytes as they come, until EOF."""
    while True:
        data = os.read(fd, size)
        if not data:
            return
        yield data
