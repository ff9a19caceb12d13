"""What ``corral serve`` counts, in Prometheus's text format (``prometheus_client``).

Each server has its own registry (two servers in one process, as in the tests, never mix).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

START_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.boxes = Gauge("corral_boxes", "Boxes held, by state", ["state"], registry=r)
        self.one_shots = Gauge(
            "corral_one_shots",
            "One-shot runs in progress (they count against --max-boxes with the boxes held)",
            registry=r,
        )
        self.starts = Counter(
            "corral_box_starts", "Boxes started, by how (cold or pool)", ["how"], registry=r
        )
        self.start_failures = Counter(
            "corral_box_start_failures", "Box starts that failed, by code", ["code"], registry=r
        )
        self.start_seconds = Histogram(
            "corral_box_start_seconds",
            "Time from request to a ready box",
            ["how"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.pool_hits = Counter(
            "corral_pool_hits", "One-shot runs served by a warm box", registry=r
        )
        self.commands = Counter(
            "corral_commands", "Commands run, by how they ended", ["ended"], registry=r
        )
        self.timeouts = Counter("corral_command_timeouts", "Commands ended by timeout", registry=r)
        self.oom_kills = Counter(
            "corral_oom_kills", "Processes killed by a box's memory limit", registry=r
        )
        self.proxy_refusals = Counter(
            "corral_proxy_refusals", "Connections the network policy refused", registry=r
        )
        self.reaped = Counter(
            "corral_boxes_reaped", "Boxes closed by the reaper, by why", ["why"], registry=r
        )
        self.requests = Counter(
            "corral_http_requests", "API requests, by status class", ["status"], registry=r
        )

    def ended(self, ended: str, timed_out: bool) -> None:
        self.commands.labels(ended=ended).inc()
        if timed_out:
            self.timeouts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
