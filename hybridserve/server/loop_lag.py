"""How late the event loop wakes a sleeper: any work that holds the loop delays every stream by as much."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class LoopLagMonitor:
    """Sleeps ``interval_s`` over and over on the loop and records how much later than asked it woke:
    ``hybridserve_event_loop_lag_seconds`` (a histogram) and its maximum since start."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.lag = Histogram(
            "hybridserve_event_loop_lag_seconds",
            "how late the event loop woke a timer (a stalled loop delays every stream)",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.max_lag = Gauge(
            "hybridserve_event_loop_lag_max_seconds",
            "the longest event loop lag since start",
            registry=registry,
        )
        self.worst = 0.0
        self.ticks = 0

    async def run(self) -> None:
        while True:
            asked = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, time.perf_counter() - asked))

    def record(self, lag: float) -> None:
        self.ticks += 1
        self.lag.observe(lag)
        if lag > self.worst:
            self.worst = lag
            self.max_lag.set(lag)
