"""A failing step fails only the requests that fail alone and frees their blocks; a step that keeps
failing is fatal."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.core.engine_core import MAX_CONSECUTIVE_STEP_FAILURES
from hybridserve.engine.core.scheduler import SchedulerOutput
from hybridserve.engine.errors import EngineDeadError
from hybridserve.engine.request import FinishReason, Request


def test_a_failed_step_finishes_its_requests_with_error_and_frees_them(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    core = LLM(str(tiny_checkpoint("mixed")), block_tokens=8, enforce_eager=True).engine
    execute = core.runner.execute

    def faulty(out: SchedulerOutput) -> Any:
        if any(s.request.request_id == "bad" for s in out.scheduled):
            raise RuntimeError("boom")
        return execute(out)

    core.runner.execute = faulty  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good = Request("good", [3, 4, 5], params)
    core.add_request(good)
    while not good.output_token_ids:
        core.step()
    bad = Request("bad", [6, 7], params)
    core.add_request(bad)
    outputs = core.step()  # the good decode and the bad prefill share this step: it runs again, each alone
    finished = {o.request_id: o.finish_reason for o in outputs}
    assert finished == {"good": None, "bad": FinishReason.ERROR}
    assert all("boom" in (o.error or "") for o in outputs if o.request_id == "bad")
    assert core.stats.failed_steps == 1
    while core.has_unfinished_requests():
        core.step()
    assert good.finish_reason is FinishReason.LENGTH and len(good.output_token_ids) == 4
    assert core.pools.all_free()
    core.pools.check_integrity()
    again = Request("again", [3, 4, 5], params)
    core.add_request(again)
    while core.has_unfinished_requests():
        core.step()
    assert again.finish_reason is FinishReason.LENGTH and core.stats.consecutive_failures == 0
    assert again.output_token_ids == good.output_token_ids  # the rerun step computed what one step would


def test_steps_that_keep_failing_make_the_engine_dead(tiny_checkpoint: Callable[[str], Path]) -> None:
    core = LLM(str(tiny_checkpoint("mixed")), block_tokens=8, enforce_eager=True).engine

    def broken(out: SchedulerOutput) -> Any:
        raise RuntimeError("device lost")

    core.runner.execute = broken  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=4)
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        core.add_request(Request(f"r{i}", [3, 4], params))
        core.step()
    core.add_request(Request("last", [3, 4], params))
    with pytest.raises(EngineDeadError, match="in a row"):
        core.step()
