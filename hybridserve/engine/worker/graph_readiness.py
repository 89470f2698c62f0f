"""Which compiled parts of the worker a step may take, while they compile in the background.

Until a background warm-up starts, every part may be taken (one not yet compiled compiles in the step
that first takes it, or in ``ModelRunner.warmup``). While one runs, a part is taken once it is compiled,
and only while nothing is being compiled: dynamo's stances (``eager_on_recompile``, skipped guards) are
process-wide, so a step that set one beside a compile in the other thread would keep that compile from
happening. A step that finds a compile under way runs eagerly; it never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Iterator
from contextlib import contextmanager

TAIL, DECODE, DRAFT, PREFILL = "mHC tail", "decode step", "draft step", "prefill graph"


class _Every(Container[str]):
    def __contains__(self, name: object) -> bool:
        return True


EVERY = _Every()


class GraphReadiness:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gated = False
        self._start = time.perf_counter()
        self.ready_after: dict[str, float] = {}  # part -> seconds from start-up until it was compiled
        self.full_speed_after: float | None = None  # seconds from start-up until every part was

    def start_gating(self) -> None:
        """From now until ``all_ready``, parts are taken only once ``ready``."""
        self._gated = True

    def ready(self, name: str) -> None:
        self.ready_after[name] = time.perf_counter() - self._start

    def all_ready(self) -> float:
        """Every part is compiled: steps take them all, without the lock. -> seconds since start-up."""
        self.full_speed_after = time.perf_counter() - self._start
        self._gated = False
        return self.full_speed_after

    @contextmanager
    def compiling(self) -> Iterator[None]:
        with self._lock:
            yield

    @contextmanager
    def use(self) -> Iterator[Container[str]]:
        """The parts this step may take: every part, or while gated those compiled (none while a compile
        is under way)."""
        if not self._gated:
            yield EVERY
            return
        if not self._lock.acquire(blocking=False):
            yield ()
            return
        try:
            yield dict(self.ready_after)
        finally:
            self._lock.release()
