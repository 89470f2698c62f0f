"""Faults injected into the engine-core process through $HYBRIDSERVE_PLUGINS (``tests.server.faults:NAME``).

``poison_step``: a step holding a request whose prompt contains POISON raises inside the forward (the
engine fails that step's requests and goes on). ``fatal_schedule``: a waiting request whose prompt contains
FATAL makes the scheduler raise (the engine's state is unknown: it cannot go on).
"""

from __future__ import annotations

from typing import Any

from hybridserve.engine.core.scheduler import Scheduler, SchedulerOutput
from hybridserve.engine.worker.model_runner import ModelRunner

POISON = 311
FATAL = 313


def poison_step() -> None:
    execute = ModelRunner.execute

    def faulty(self: ModelRunner, out: SchedulerOutput) -> Any:
        if any(POISON in s.request.prompt_token_ids for s in out.scheduled):
            raise RuntimeError("injected step fault")
        return execute(self, out)

    ModelRunner.execute = faulty  # type: ignore[method-assign]


def fatal_schedule() -> None:
    schedule = Scheduler.schedule

    def faulty(self: Scheduler) -> SchedulerOutput:
        if any(FATAL in r.prompt_token_ids for r in self.waiting):
            raise RuntimeError("injected scheduler fault")
        return schedule(self)

    Scheduler.schedule = faulty  # type: ignore[method-assign]
