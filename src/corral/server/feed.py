"""The live audit stream of ``corral serve``: every record of the boxes it holds (kept
whether or not a policy names an audit file; not the one-shots of ``corral run``), the last
few kept for late readers.

Records may come from any thread; readers are asyncio queues on the server's loop. A reader
that falls behind by ``QUEUE`` records loses the oldest of them rather than holding the boxes up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import weakref
from typing import Any

from corral.audit import AuditListener

__all__ = ["AuditFeed"]

KEEP = 500
QUEUE = 1000


class AuditFeed:
    def __init__(self, keep: int = KEEP) -> None:
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        # Weak: a stream whose response never started (its client went away first) never
        # runs the generator that would close its reader; its queue goes with the generator.
        self._readers: weakref.WeakSet[asyncio.Queue[dict[str, Any]]] = weakref.WeakSet()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._deferred = 0  # records on their way to the loop (guarded by _lock)
        self._lock = threading.Lock()

    def bind(self) -> None:
        """Remember the server's loop (call from it) for records that come from threads."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()

    def listener(self, box_id: str) -> AuditListener:
        """A listener for one box's :class:`~corral.audit.AuditLog` (``AuditLog.listen``)."""

        def listen(record: dict[str, Any]) -> None:
            self.publish({**record, "box": box_id})

        return listen

    def publish(self, record: dict[str, Any]) -> None:
        """Deliver ``record`` to every reader, in the order records were published: one
        from the loop's thread waits its turn behind those other threads sent first."""
        loop = self._loop
        if loop is None:
            self._deliver(record)
            return
        with self._lock:
            if threading.get_ident() == self._thread and not self._deferred:
                self._deliver(record)
                return
            self._deferred += 1
        try:
            loop.call_soon_threadsafe(self._deliver_deferred, record)
        except RuntimeError:  # the loop is closed: the server ended
            with self._lock:
                self._deferred -= 1

    def _deliver_deferred(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._deferred -= 1
        self._deliver(record)

    def _deliver(self, record: dict[str, Any]) -> None:
        self.recent.append(record)
        for queue in self._readers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(record)

    def open_reader(self) -> tuple[list[dict[str, Any]], asyncio.Queue[dict[str, Any]]]:
        """The records kept so far, and a queue of those to come from now on (no await
        between): a stream opens it before its response starts, so that every record after
        the client saw the response's headers reaches it. :meth:`close_reader` ends it."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=QUEUE)
        self._readers.add(queue)
        return list(self.recent), queue

    def close_reader(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._readers.discard(queue)
