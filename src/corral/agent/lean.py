"""What the guest agent needs before it is ready, from the C halves of the stdlib.

Every box start runs ``python3 -I -S agent.py``, and everything the agent imports before it
says "ready" is on the path of create-to-ready. ``json``, ``selectors``, ``socket`` and
``signal`` are thin Python layers over C modules, but importing them pulls in ``re``,
``enum``, ``collections`` and more: measured here, ``import socket, signal, selectors, json``
costs about 14 ms of CPU more than ``import _socket, _signal, select, _json``, while the
whole interpreter starts in about 10. This module gives the agent the few functions it uses
on top of the C modules:

- :func:`dumps` / :func:`loads`: ``json.dumps(obj, separators=(",", ":"))`` and
  ``json.loads`` with the same C encoder and scanner ``json`` itself uses (a test holds them
  equal); errors are ``ValueError`` as with ``json``.
- :class:`Poller`: the part of ``selectors.DefaultSelector`` the agent's loop uses, on
  ``select.epoll`` (read/write events mapped as ``selectors.EpollSelector`` maps them).
- :func:`contextmanager`: ``contextlib.contextmanager`` for the agent's own generators
  (``contextlib`` imports ``collections`` and ``functools``: about 5 ms of CPU).

Stdlib only; the host imports it too (through ``corral.agent.protocol``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # the guest agent does not import typing
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, ParamSpec, TypeVar

    P = ParamSpec("P")
    T = TypeVar("T")

try:
    import _json
except ImportError:  # pragma: no cover - an interpreter without the C accelerator
    _json = None  # type: ignore[assignment]

EVENT_READ = 1
EVENT_WRITE = 2
_WHITESPACE = " \t\n\r"
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _ScanContext:
    """The attributes ``_json.make_scanner`` reads (``json.JSONDecoder``'s defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__
    memo: dict[str, str] = {}


def _no_default(obj: object) -> object:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


if _json is not None:
    _scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # typeshed: its own type
    _encode = _json.make_encoder(
        {}, _no_default, _json.encode_basestring_ascii, None, ":", ",", False, False, True
    )


def dumps(obj: Any) -> str:
    """``json.dumps(obj, separators=(",", ":"))``."""
    if _json is None:  # pragma: no cover
        import json

        return json.dumps(obj, separators=(",", ":"))
    return "".join(_encode(obj, 0))


def loads(data: str | bytes) -> Any:
    """``json.loads(data)`` (bytes must be UTF-8); ``ValueError`` when it is not JSON."""
    text = data.decode() if isinstance(data, bytes | bytearray) else data
    if _json is None:  # pragma: no cover
        import json

        return json.loads(text)
    end = len(text)
    start = 0
    while start < end and text[start] in _WHITESPACE:
        start += 1
    try:
        value, stop = _scan(text, start)
    except StopIteration as exc:
        raise ValueError(f"not JSON: nothing valid at character {exc.value}") from None
    while stop < end and text[stop] in _WHITESPACE:
        stop += 1
    if stop != end:
        raise ValueError(f"not JSON: extra data at character {stop}")
    return value


class Key:
    """What ``selectors`` calls a ``SelectorKey``: the registered object, its fd, events and
    data."""

    __slots__ = ("data", "events", "fd", "fileobj")

    def __init__(self, fileobj: Any, fd: int, events: int, data: Any) -> None:
        self.fileobj = fileobj
        self.fd = fd
        self.events = events
        self.data = data


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class Poller:
    """``register``/``modify``/``unregister``/``get_map``/``select``/``close`` of
    ``selectors.DefaultSelector``, on ``select.epoll`` (Linux, as every box is)."""

    def __init__(self) -> None:
        import select

        self._epoll = select.epoll()
        self._keys: dict[int, Key] = {}
        self._in = select.EPOLLIN
        self._out = select.EPOLLOUT

    def _mask(self, events: int) -> int:
        if not events or events & ~(EVENT_READ | EVENT_WRITE):
            raise ValueError(f"invalid events: {events!r}")
        return (self._in if events & EVENT_READ else 0) | (self._out if events & EVENT_WRITE else 0)

    def register(self, fileobj: Any, events: int, data: Any = None) -> Key:
        fd = _fd(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is already registered")
        mask = self._mask(events)
        key = Key(fileobj, fd, events, data)
        self._epoll.register(fd, mask)
        self._keys[fd] = key
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> Key:
        fd = _fd(fileobj)
        key = self._keys.get(fd)
        if key is None:
            raise KeyError(f"{fileobj!r} (fd {fd}) is not registered")
        if events != key.events:
            self._epoll.modify(fd, self._mask(events))
            key.events = events
        key.data = data
        return key

    def unregister(self, fileobj: Any) -> Key:
        fd = _fd(fileobj)
        key = self._keys.pop(fd)
        try:
            self._epoll.unregister(fd)
        except OSError:
            pass  # already closed: epoll forgot it with the fd
        return key

    def get_map(self) -> dict[int, Key]:
        """The registered keys by fd (a copy)."""
        return dict(self._keys)

    def select(self, timeout: float | None = None) -> list[tuple[Key, int]]:
        wait = -1.0 if timeout is None else max(timeout, 0.0)
        ready = []
        for fd, event in self._epoll.poll(wait, max(len(self._keys), 1)):
            key = self._keys.get(fd)
            if key is None:
                continue
            # As selectors.EpollSelector: HUP and ERR wake readers and writers alike.
            events = (EVENT_WRITE if event & ~self._in else 0) | (
                EVENT_READ if event & ~self._out else 0
            )
            if events & key.events:
                ready.append((key, events & key.events))
        return ready

    def close(self) -> None:
        self._epoll.close()
        self._keys.clear()


class _GeneratorContext:
    """The context manager of one call of a :func:`contextmanager` function."""

    __slots__ = ("gen",)

    def __init__(self, gen: Iterator[Any]) -> None:
        self.gen = gen

    def __enter__(self) -> Any:
        try:
            return next(self.gen)
        except StopIteration:
            raise RuntimeError("generator didn't yield") from None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            try:
                next(self.gen)
            except StopIteration:
                return False
            raise RuntimeError("generator didn't stop")
        try:
            self.gen.throw(exc)  # type: ignore[attr-defined]  # a generator's
        except StopIteration as stop:
            return stop is not exc  # the generator swallowed the exception
        except BaseException as raised:
            if raised is exc:
                return False  # the same exception goes on, from the with block
            if isinstance(exc, StopIteration) and raised.__cause__ is exc:
                return False  # PEP 479 turned the body's StopIteration into a RuntimeError
            raise
        raise RuntimeError("generator didn't stop after throw()")


def contextmanager(func: Callable[P, Iterator[T]]) -> Callable[P, _GeneratorContext]:
    """``contextlib.contextmanager``, without importing ``contextlib``."""

    def make(*args: P.args, **kwargs: P.kwargs) -> _GeneratorContext:
        return _GeneratorContext(func(*args, **kwargs))

    make.__name__ = func.__name__
    make.__doc__ = func.__doc__
    return make
