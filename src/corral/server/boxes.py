"""The boxes ``corral serve`` holds: made on request, closed on delete, at their TTL or when
idle, and all of them when the server stops.

- **A cap on boxes starting at once** (``max_starting``) and a start-time budget
  (``start_timeout``): past either, the caller gets ``server_busy`` (retryable), never a hang.
- **A cap on boxes** (``max_boxes``): those held, those starting for a create, and the
  one-shots running. A create past it is refused (``server_busy``) at once; a one-shot waits
  for room up to the start budget, then is refused the same way (``corral run`` is a
  command a person or a script runs N at once: they take turns rather than fail).
- **One-shot runs** (``corral run`` through the server) take a box from a warm pool kept per
  policy, as :class:`~corral.pool.SandboxPool` does in-process; the least recently used pool
  is closed past ``max_pools``. (A pool's warm spares are not counted: ``pool_size`` per
  pool, ``max_pools`` pools, bound them.)
- **The reaper** closes a box past its TTL (from creation) or its idle timeout (from the last
  request that touched it, a running process, an attached terminal or a request waiting on
  the box counting as activity). A terminal session's shell is not a running process here:
  it sits at its prompt for as long as the session is open, which would keep every box an
  agent ever opened ``sb.shell()`` in alive forever. A session nobody is attached to, writes
  to or waits on (``expect``) is idle, whatever runs in it.
- **No box outlives the server.** Every box process is tied to the server's life (bwrap's
  monitor dies with its parent thread; qemu and OCI runtimes likewise), and each backend's
  orphan sweep clears what a killed server left (state directories, cgroups, mounts) on the
  next start. A restarted server therefore starts empty: boxes are reaped, not re-adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from corral import errors
from corral.models import NetworkRefusal
from corral.policy import Policy
from corral.pool import SandboxPool
from corral.sandbox import Sandbox
from corral.server.feed import AuditFeed
from corral.server.metrics import Metrics

__all__ = ["Boxes", "HeldBox", "ServeLimits"]

logger = logging.getLogger("corral.server")


@dataclass(frozen=True)
class ServeLimits:
    """The server's own limits (``corral serve`` flags)."""

    max_boxes: int = 64
    max_starting: int = 4
    start_timeout: float = 60.0
    default_ttl: float | None = None
    default_idle: float | None = None
    pool_size: int = 2
    max_pools: int = 4
    reap_interval: float = 0.5


@dataclass
class HeldBox:
    id: str
    sandbox: Sandbox
    labels: dict[str, str]
    ttl: float | None
    idle_timeout: float | None
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    _born: float = field(default_factory=time.monotonic)
    ended: str | None = None
    """Why the server closed it (``deleted``, ``ttl``, ``idle``, ``shutdown``), once it has."""
    oom_counted: int = 0
    """Its OOM kills already in ``corral_oom_kills_total``."""
    refusal_counted: NetworkRefusal | None = None
    """The newest of its network refusals already in ``corral_proxy_refusals_total``."""
    waiting: int = 0
    """Requests waiting on the box (an ``expect`` on a session): activity while they wait."""

    @property
    def state(self) -> str:
        sb = self.sandbox
        if sb.closed:
            return "closed"
        if sb.broken is not None:
            return "broken"
        return "paused" if sb.paused else "running"

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @contextlib.contextmanager
    def waited_on(self) -> Iterator[None]:
        """A request waiting on the box for as long as it takes (an ``expect`` longer than
        the idle timeout must not lose its box under it)."""
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self.touch()

    def busy(self) -> bool:
        """A process still running (not a session's shell: see the module's docstring), a
        person attached or a request waiting: activity the idle timer respects."""
        sb = self.sandbox
        if sb.closed or sb.paused:
            return False
        if self.waiting:
            return True
        sessions = sb.sessions()
        shells = {s.process.pid for s in sessions}
        if any(p.status == "running" and p.pid not in shells for p in sb.processes()):
            return True
        return any(s.attached for s in sessions)

    def expired(self, now: float) -> str | None:
        """Why the reaper should close this box now (``ttl``/``idle``), or None."""
        if self.ttl is not None and now - self._born >= self.ttl:
            return "ttl"
        if self.idle_timeout is not None and now - self.last_active >= self.idle_timeout:
            if self.busy():
                self.touch()
                return None
            return "idle"
        if self.sandbox.closed:
            return "closed"
        return None

    def describe(self) -> dict[str, Any]:
        sb = self.sandbox
        now = time.monotonic()
        out: dict[str, Any] = {
            "id": self.id,
            "sandbox_id": sb.sandbox_id,
            "state": self.state,
            "labels": dict(self.labels),
            "created_at": self.created_at,
            "ttl_secs": self.ttl,
            "idle_timeout_secs": self.idle_timeout,
            "expires_in_secs": None
            if self.ttl is None
            else max(0.0, self.ttl - (now - self._born)),
            "idle_secs": now - self.last_active,
            "backend": sb.policy.backend,
            "network": sb.policy.network.mode,
            "warnings": list(sb.warnings),
            "processes": sum(1 for p in sb.processes() if p.status == "running")
            if not sb.closed
            else 0,
            "sessions": [s.session_id for s in sb.sessions()] if not sb.closed else [],
            "limits": sb.policy.limits.model_dump(mode="json"),
            "published": [str(p) for p in sb.published] if not sb.closed else [],
        }
        if sb.broken is not None and not sb.closed:
            out["broken"] = sb.broken  # the box died: delete it (its processes are gone)
        if not sb.closed:
            stats = sb.stats()
            out["stats"] = {
                "memory_bytes": stats.memory_bytes,
                "memory_peak_bytes": stats.memory_peak_bytes,
                "cpu_seconds": stats.cpu_seconds,
                "pids": stats.pids,
                "oom_kills": stats.oom_kills,
            }
        return out


BOX_STATES = ("running", "paused", "broken")
"""The states ``corral_boxes`` counts the boxes held in (0 included, for alerts)."""


def new_box_id() -> str:
    return "box-" + secrets.token_hex(6)


class Boxes:
    """The server's boxes by id, its warm pools, and the reaper."""

    def __init__(self, limits: ServeLimits, metrics: Metrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self._held: dict[str, HeldBox] = {}
        self._reserved = 0
        """Boxes being started for a create or a fork: counted against ``max_boxes`` from
        the request on, so concurrent requests cannot all pass the cap."""
        self._one_shots = 0
        """One-shot runs in progress (from the room they found to their box's closing end):
        counted against ``max_boxes`` too."""
        self._room: set[asyncio.Future[None]] = set()
        """One-shots waiting for room under ``max_boxes``: woken when a box goes."""
        self._starting = asyncio.Semaphore(limits.max_starting)
        self._pools: OrderedDict[str, SandboxPool] = OrderedDict()
        self._pool_lock = asyncio.Lock()
        self._closing = False
        self._in_flight: set[Sandbox] = set()
        """The boxes of one-shot commands in flight (closed at shutdown with the rest)."""
        self._background: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.audit = AuditFeed()
        """Every audit record of the boxes held and the one-shots run (GET /v1/audit)."""

    # ---- lifecycle -----------------------------------------------------------------------
    def start_reaper(self) -> None:
        self.audit.bind()
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="corral-reaper")

    @property
    def closing(self) -> bool:
        """The server is stopping: its boxes are being closed, none is made."""
        return self._closing

    async def aclose(self) -> None:
        """Close every box and pool (the server is stopping): held boxes, the one-shots in
        flight and the pools at once, so that the requests using them end with the error
        that says so (``server_unavailable``, retryable) while the server still answers."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        held, self._held = list(self._held.values()), {}
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for h in held:
            h.ended = "shutdown"
        results = await asyncio.gather(
            *(h.sandbox.aclose() for h in held),
            *(sb.aclose() for sb in list(self._in_flight)),
            *(p.aclose() for p in pools),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("closing at shutdown: %s", result)
        self._gauge()

    def _gauge(self) -> None:
        states = dict.fromkeys(BOX_STATES, 0)
        for held in self._held.values():
            states[held.state] = states.get(held.state, 0) + 1
        for state, count in states.items():
            self.metrics.boxes.labels(state=state).set(count)
        self.metrics.one_shots.set(self._one_shots)

    def observe(self) -> None:
        """Bring ``/metrics`` up to now: boxes by state (a pause, a resume, an agent's death
        change it outside any request of ours) and the OOM kills and network refusals of the
        boxes held so far, counted as they happen rather than when a box goes."""
        self._gauge()
        for held in self._held.values():
            self._count_held(held)

    def _counted(self) -> int:
        """What counts against ``max_boxes``."""
        return len(self._held) + self._reserved + self._one_shots

    def _freed(self) -> None:
        """A box went (or a start failed): the one-shots waiting for room look again."""
        waiting, self._room = self._room, set()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for_room(self) -> None:
        """Room for one more box within the start budget, else ``server_busy``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.start_timeout):
                while self._counted() >= self.limits.max_boxes:
                    waiter = loop.create_future()
                    self._room.add(waiter)
                    try:
                        await waiter
                    finally:
                        self._room.discard(waiter)
        except TimeoutError:
            self.metrics.start_failures.labels(code="server_busy").inc()
            raise errors.ServerBusy(
                f"the server held its maximum of {self.limits.max_boxes} boxes (held and "
                f"one-shots running) for the whole {self.limits.start_timeout:g} s start "
                "budget; retry later, or raise corral serve --max-boxes"
            ) from None

    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise errors.ServerUnavailable("the server is shutting down; retry on its successor")

    @contextlib.asynccontextmanager
    async def _start_slot(self, how: str) -> AsyncIterator[None]:
        """A place among the boxes starting at once, within the start budget."""
        try:
            async with asyncio.timeout(self.limits.start_timeout):
                await self._starting.acquire()
        except TimeoutError:
            self.metrics.start_failures.labels(code="server_busy").inc()
            raise errors.ServerBusy(
                f"{self.limits.max_starting} boxes were starting for longer than the "
                f"{self.limits.start_timeout:g} s start budget; retry later"
            ) from None
        began = time.monotonic()
        try:
            try:
                async with asyncio.timeout(self.limits.start_timeout):
                    yield
            except TimeoutError:
                self.metrics.start_failures.labels(code="server_busy").inc()
                raise errors.ServerBusy(
                    f"the box did not start within the {self.limits.start_timeout:g} s start "
                    "budget; the machine may be overloaded: retry later"
                ) from None
            except errors.SandboxError as exc:
                self.metrics.start_failures.labels(code=str(exc.code)).inc()
                raise
            self.metrics.starts.labels(how=how).inc()
            self.metrics.start_seconds.labels(how=how).observe(time.monotonic() - began)
        finally:
            self._starting.release()

    # ---- boxes by id ---------------------------------------------------------------------
    async def create(
        self,
        policy: Policy,
        *,
        workspace: str | None = None,
        labels: dict[str, str] | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        allow_dangerous_workspace: bool = False,
    ) -> HeldBox:
        self._refuse_if_closing()
        with self.reserve(1):
            box_id = new_box_id()
            sb = await self._cold(policy, workspace, allow_dangerous_workspace, box_id)
            held = HeldBox(
                id=box_id,
                sandbox=sb,
                labels=dict(labels or {}),
                ttl=ttl if ttl is not None else self.limits.default_ttl,
                idle_timeout=idle_timeout if idle_timeout is not None else self.limits.default_idle,
            )
            if self._closing:  # the server began to stop while this box started
                await sb.aclose()
                self._refuse_if_closing()
            self._held[held.id] = held
        self._gauge()
        return held

    @contextlib.contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        """Room for ``n`` more boxes while they start (``server_busy`` if the cap has none):
        what is held plus what other requests are starting counts."""
        if self._counted() + n > self.limits.max_boxes:
            raise errors.ServerBusy(
                f"the server holds its maximum of {self.limits.max_boxes} boxes (counting "
                "those starting and the one-shots running); delete one or raise corral "
                "serve --max-boxes"
            )
        self._reserved += n
        try:
            yield
        finally:
            self._reserved -= n
            self._freed()  # room again if the start failed

    def adopt(self, sb: Sandbox, labels: dict[str, str]) -> HeldBox:
        """Hold a sandbox started elsewhere (a fork), with the server's default lease."""
        held = HeldBox(
            id=new_box_id(),
            sandbox=sb,
            labels=dict(labels),
            ttl=self.limits.default_ttl,
            idle_timeout=self.limits.default_idle,
        )
        sb.audit.listen(self.audit.listener(held.id))
        self._held[held.id] = held
        self._gauge()
        return held

    async def _cold(
        self,
        policy: Policy,
        workspace: str | None,
        allow_dangerous_workspace: bool,
        box_id: str | None = None,
    ) -> Sandbox:
        """A box started for this request alone, within the start cap and budget; a held
        box's audit records go to the server's feed as ``box_id``'s. One-shots (``corral
        run``'s path) stay out of it: auditing a command costs about 1 ms (a stats read at
        its spawn and its exit), a third of a pooled run."""
        sb = Sandbox(
            policy,
            workspace=workspace,
            allow_dangerous_workspace=allow_dangerous_workspace,
            exposable=True,  # POST /v1/boxes/{id}/ports works in every network mode
        )
        if box_id is not None:
            sb.audit.listen(self.audit.listener(box_id))
        async with self._start_slot("cold"):
            try:
                await sb.start()
            except BaseException:
                await sb.aclose()
                raise
        return sb

    def get(self, box_id: str, *, touch: bool = True) -> HeldBox:
        """The box ``box_id``; ``touch``: this request is activity (the idle timer restarts),
        as commands, files and terminals are and looking at its state is not."""
        held = self._held.get(box_id)
        if held is None:
            raise errors.BoxNotFound(
                f"no box {box_id!r} on this server (deleted, reaped at its TTL or idle "
                "timeout, or never made): GET /v1/boxes lists the boxes there are"
            )
        if touch:
            held.touch()
        return held

    def matching(self, labels: dict[str, str] | None = None) -> list[HeldBox]:
        wanted = labels or {}
        return [
            h for h in self._held.values() if all(h.labels.get(k) == v for k, v in wanted.items())
        ]

    async def remove(self, box_id: str, why: str = "deleted") -> None:
        held = self._held.pop(box_id, None)
        if held is None:
            self.get(box_id)  # raises BoxNotFound
            return
        held.ended = why
        self._gauge()
        self._freed()
        if why != "deleted":
            self.metrics.reaped.labels(why=why).inc()
        self._count_held(held)
        await held.sandbox.aclose()

    def _count_held(self, held: HeldBox) -> None:
        """Count what a held box's OOM kills and refusals grew by since last counted."""
        sb = held.sandbox
        if sb.closed:
            return
        with contextlib.suppress(errors.SandboxError):
            kills = sb.oom_kills()
            if kills > held.oom_counted:
                self.metrics.oom_kills.inc(kills - held.oom_counted)
                held.oom_counted = kills
        refusals = sb.network_refusals()
        if refusals and refusals[-1] is not held.refusal_counted:
            # The box keeps its most recent refusals: those after the last one counted (all
            # it keeps when that one has been dropped since).
            seen = [i for i, r in enumerate(refusals) if r is held.refusal_counted]
            self.metrics.proxy_refusals.inc(len(refusals) - (seen[-1] + 1 if seen else 0))
            held.refusal_counted = refusals[-1]

    def _count_box(self, sb: Sandbox) -> None:
        """Count a one-shot's OOM kills and refusals (it lives for one command)."""
        if sb.closed:
            return
        with contextlib.suppress(errors.SandboxError):
            self.metrics.oom_kills.inc(sb.oom_kills())
        self.metrics.proxy_refusals.inc(len(sb.network_refusals()))

    # ---- one-shot runs from warm pools ---------------------------------------------------
    async def _pool(self, policy: Policy) -> SandboxPool:
        key = policy.model_dump_json()
        async with self._pool_lock:
            pool = self._pools.get(key)
            if pool is not None:
                self._pools.move_to_end(key)
                return pool
            pool = SandboxPool(policy, size=self.limits.pool_size)
            await pool.start()
            self._pools[key] = pool
            while len(self._pools) > self.limits.max_pools:
                _, old = self._pools.popitem(last=False)
                self._in_background(old.aclose())
            return pool

    @contextlib.asynccontextmanager
    async def one_shot(
        self, policy: Policy, workspace: str | None, *, allow_dangerous_workspace: bool = False
    ) -> AsyncIterator[Sandbox]:
        """A started box for one command, from the policy's warm pool where it can be,
        once there is room for it under ``max_boxes``."""
        self._refuse_if_closing()
        await self._wait_for_room()
        self._one_shots += 1
        self._gauge()
        try:
            # A box of its own for a workspace pools refuse, and for one that publishes
            # ports: a pool refuses a fixed host port (its boxes cannot all take it), and
            # its warm boxes would hold host ports nobody was told of.
            if allow_dangerous_workspace or policy.network.publish:
                sb = await self._cold(policy, workspace, allow_dangerous_workspace)
            else:
                pool = await self._pool(policy)
                warm = pool.ready > 0
                async with self._start_slot("pool" if warm else "cold"):
                    sb = await pool.sandbox(workspace)
                if warm:
                    self.metrics.pool_hits.inc()
        except BaseException:
            self._one_shot_gone()
            raise
        self._in_flight.add(sb)
        try:
            yield sb
        finally:
            self._in_flight.discard(sb)
            self._count_box(sb)
            # Closed in the background: the caller's answer is complete without waiting for
            # the teardown (a shutdown still waits for it, see aclose). It counts against
            # the cap until it is gone: its memory and processes are there until then.
            self._in_background(self._close_one_shot(sb))

    async def _close_one_shot(self, sb: Sandbox) -> None:
        try:
            await sb.aclose()
        finally:
            self._one_shot_gone()

    def _one_shot_gone(self) -> None:
        self._one_shots -= 1
        self._gauge()
        self._freed()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- the reaper ----------------------------------------------------------------------
    async def reap_once(self) -> list[str]:
        now = time.monotonic()
        due = [(h.id, why) for h in list(self._held.values()) if (why := h.expired(now))]
        for box_id, why in due:
            with contextlib.suppress(errors.BoxNotFound):
                await self.remove(box_id, why)
            logger.info("reaped %s (%s)", box_id, why)
        return [box_id for box_id, _ in due]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.limits.reap_interval)
            try:
                await self.reap_once()
            except Exception:  # the reaper must outlive one bad close
                logger.exception("the reaper failed once")
