"""Faults injected into engine-core ranks through $HYBRIDSERVE_PLUGINS (``tests.distributed.faults:NAME``).

``kill_rank_1``: rank 1 exits abruptly (no message, no cleanup) at its fourth step, mid-run.
``kill_on_token``: the rank holding a request whose prompt contains KILL exits at its next step.
"""

from __future__ import annotations

import os
from typing import Any

from hybridserve.engine.core.engine_core import EngineCore

KILL_AT_STEP = 4


def kill_rank_1() -> None:
    step = EngineCore.step

    def dying(self: EngineCore) -> Any:
        if self.config.data_parallel_rank == 1 and self.stats.steps + 1 >= KILL_AT_STEP:
            os._exit(17)
        return step(self)

    EngineCore.step = dying  # type: ignore[method-assign]


KILL = 317


def kill_on_token() -> None:
    """A rank exits abruptly at the first step that holds a request whose prompt contains KILL."""
    step = EngineCore.step

    def dying(self: EngineCore) -> Any:
        if any(KILL in r.prompt_token_ids for r in self.requests.values()):
            os._exit(17)
        return step(self)

    EngineCore.step = dying  # type: ignore[method-assign]
