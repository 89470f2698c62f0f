"""Faults injected into engine-core ranks through $HYBRIDSERVE_PLUGINS (``tests.distributed.faults:NAME``).

``kill_rank_1``: rank 1 exits abruptly (no message, no cleanup) at its fourth step, mid-run.
"""

from __future__ import annotations

import os
from typing import Any

from hybridserve.engine.core import EngineCore

KILL_AT_STEP = 4


def kill_rank_1() -> None:
    step = EngineCore.step

    def dying(self: EngineCore) -> Any:
        if self.config.data_parallel_rank == 1 and self.stats.steps + 1 >= KILL_AT_STEP:
            os._exit(17)
        return step(self)

    EngineCore.step = dying  # type: ignore[method-assign]
