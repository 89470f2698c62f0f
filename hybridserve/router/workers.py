"""The router's view of its workers: which are up, how busy, and a health loop that takes them back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from hybridserve.server.errors import APIError

log = logging.getLogger("hybridserve.router")
T = TypeVar("T")


class WorkerDown(Exception):
    def __init__(self, worker: Worker, why: str) -> None:
        super().__init__(f"the {worker.role} worker at {worker.url} failed: {why}")
        self.worker = worker


@dataclass(eq=False)
class Worker:
    url: str
    role: str  # "prefill" or "decode"
    up: bool = True
    in_flight: int = 0
    slow_checks: int = 0  # health checks in a row that timed out
    down_event: asyncio.Event = field(default_factory=asyncio.Event)

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work``; raise WorkerDown as soon as this worker is marked down (or ``work`` fails to
        reach it), so that no request waits on a dead or hung worker."""
        task = asyncio.ensure_future(work)
        down = asyncio.ensure_future(self.down_event.wait())
        try:
            done, _ = await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, down):
                if not t.done():
                    t.cancel()
        if task not in done:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise WorkerDown(self, "it stopped answering its health checks")
        try:
            return task.result()
        except httpx.TransportError as exc:
            raise WorkerDown(self, f"{type(exc).__name__}: {exc}") from exc


class WorkerPool:
    """Workers of one role; ``pick`` takes the least busy one that is up (round robin among equals)."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"give at least one --{role} URL")
        self.role = role
        self.workers = [Worker(u.rstrip("/"), role) for u in urls]
        self._turn = itertools.count()

    def pick(self, exclude: set[Worker] | None = None) -> Worker:
        up = [w for w in self.workers if w.up and w not in (exclude or set())]
        if not up:
            raise APIError(
                503, f"no {self.role} worker is available; retry later", code="no_worker_available"
            )
        turn = next(self._turn)
        return min(up, key=lambda w: (w.in_flight, (self.workers.index(w) - turn) % len(self.workers)))

    @property
    def num_up(self) -> int:
        return sum(w.up for w in self.workers)


def mark_down(worker: Worker, why: str) -> None:
    if worker.up:
        log.warning("marking the %s worker at %s down: %s", worker.role, worker.url, why)
    worker.up = False
    worker.down_event.set()


def mark_up(worker: Worker) -> None:
    if not worker.up:
        log.info("the %s worker at %s is back", worker.role, worker.url)
        worker.down_event = asyncio.Event()
    worker.up = True


async def check(client: httpx.AsyncClient, worker: Worker, timeout_s: float, failures: int = 1) -> None:
    """A worker that refuses the connection or answers anything but 200 goes down at once; one that is
    only slow goes down after ``failures`` checks in a row time out, so a busy host does not flap."""
    try:
        ok = (await client.get(f"{worker.url}/health", timeout=timeout_s)).status_code == 200
        why = "its /health did not answer 200"
        worker.slow_checks = 0
    except httpx.TimeoutException as exc:
        worker.slow_checks += 1
        ok, why = worker.slow_checks < failures, f"its /health timed out {worker.slow_checks} times ({exc!r})"
    except httpx.HTTPError as exc:
        ok, why = False, f"its /health failed ({type(exc).__name__})"
    if ok and worker.slow_checks == 0:
        mark_up(worker)
    elif not ok:
        mark_down(worker, why)


async def health_loop(
    client: httpx.AsyncClient, pools: list[WorkerPool], interval_s: float, timeout_s: float, failures: int = 1
) -> None:
    """Check every worker every ``interval_s``: a hung one goes down, a recovered one comes back."""
    while True:
        workers = [w for p in pools for w in p.workers]
        await asyncio.gather(*(check(client, w, timeout_s, failures) for w in workers))
        await asyncio.sleep(interval_s)
