"""Continuous batching behaviour a user notices: decodes are never starved, long prompts are chunked,
preemption picks the newest request and never corrupts the others."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridserve import LLM, SamplingParams
from hybridserve.engine.request import Request
from hybridserve.engine.scheduler import Scheduler, SchedulerOutput


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(str(folder), block_tokens=8, **kw)


def _record(scheduler: Scheduler) -> list[tuple[list[str], SchedulerOutput]]:
    """Wrap ``schedule`` to record (running ids before the step, the step's output)."""
    steps: list[tuple[list[str], SchedulerOutput]] = []
    schedule = scheduler.schedule

    def recording() -> SchedulerOutput:
        running = [r.request_id for r in scheduler.running]
        out = schedule()
        steps.append((running, out))
        return out

    scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


def test_decodes_run_every_step_while_a_long_prompt_prefills(tiny_checkpoint: Callable[[str], Path]) -> None:
    core = _llm(tiny_checkpoint("mixed"), max_num_seqs=8, max_num_batched_tokens=8).engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = [Request(f"s{i}", [3 + i] * 4, params) for i in range(3)]
    for r in short:
        core.add_request(r)
    while any(not r.output_token_ids for r in short):
        core.step()
    long = Request("long", list(range(3, 83)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    core.add_request(long)
    steps = _record(core.scheduler)
    while long.num_computed_tokens < len(long.prompt_token_ids):
        core.step()
    chunks = []
    for _, out in steps:
        sizes = {s.request.request_id: s.num_tokens for s in out.scheduled}
        assert all(sizes.get(r.request_id) == 1 for r in short), "a decode was starved"
        chunks.append(sizes.get("long", 0))
    assert len(chunks) >= 16 and max(chunks) == 5  # 80 prompt tokens, 5 of the 8-token budget per step
    for rid in ["s0", "s1", "s2", "long"]:
        core.abort_request(rid)
    assert core.pools.all_free()


def test_preemption_takes_the_newest_and_recomputes_it(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    prompts = [list(range(3 + i, 30 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = _llm(folder, max_num_seqs=6, max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = _llm(
        folder, max_num_seqs=6, max_num_batched_tokens=64, num_blocks=16, enable_prefix_caching=False
    )
    steps = _record(tight.engine.scheduler)
    got = tight.generate(prompts, params)
    preemptions = [(running, out.preempted[0].request_id) for running, out in steps if out.preempted]
    assert preemptions, "the pool was meant to be too small for all six"
    for running, victim in preemptions:
        assert victim == running[-1], "preemption must take the newest running request"
    assert [o.outputs[0].token_ids for o in got] == expected
    assert tight.engine.pools.all_free()
