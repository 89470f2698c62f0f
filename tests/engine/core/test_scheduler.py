"""Continuous batching behaviour a user notices: decodes are never starved, long prompts are chunked,
preemption picks the newest request and never corrupts the others, and new admissions leave running
requests room to grow (the growth reserve) instead of evicting them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridserve import LLM, SamplingParams
from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import Scheduler, SchedulerOutput
from hybridserve.engine.request import Request
from tests.cache.helpers import toy_specs
from tests.tiny_models import VOCAB


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(str(folder), block_tokens=8, **kw, enforce_eager=True)


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


def _mixed_workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 4-40 tokens with 2-24 new tokens: each fits a 16-block pool alone, not all at once."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 24), ignore_eos=True) for _ in range(n)]
    return prompts, params


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_new_admissions_do_not_preempt_running_requests(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    prompts, params = _mixed_workload(40, seed=0)
    kw: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=32)
    expected = _tokens(_llm(folder, **kw), prompts, params)
    per_request = {}
    for lookahead in (0, None):  # 0: no reserve (admit whenever the first chunk fits now); None: default
        tight = _llm(folder, num_blocks=16, **kw)
        if lookahead is not None:
            tight.engine.scheduler.reserve_lookahead = lookahead
        assert _tokens(tight, prompts, params) == expected
        assert tight.engine.pools.all_free()
        tight.engine.pools.check_integrity()
        per_request[lookahead] = tight.engine.scheduler.num_preemptions / len(prompts)
    assert per_request[0] >= 0.3, "the pool was meant to make admissions evict running requests"
    assert per_request[None] <= 0.05, f"{per_request[None]:.3f} preemptions per request with the reserve"


def test_a_request_needing_the_whole_pool_still_runs(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    rng = random.Random(1)
    small = [[rng.randrange(3, VOCAB) for _ in range(12)] for _ in range(6)]
    big = [rng.randrange(3, VOCAB) for _ in range(100)]  # + 27 new tokens: 126 computed, all 16 blocks
    prompts = [*small[:3], big, *small[3:]]
    params = [
        SamplingParams(temperature=0, max_tokens=27 if p is big else 10, ignore_eos=True) for p in prompts
    ]
    kw: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=32)
    expected = _tokens(_llm(folder, **kw), prompts, params)
    tight = _llm(folder, num_blocks=16, **kw)
    assert tight.engine.max_request_tokens == 128
    assert _tokens(tight, [big], params[3:4]) == expected[3:4]  # alone
    assert _tokens(tight, prompts, params) == expected  # queued between requests that hold blocks
    assert tight.engine.pools.all_free()


def test_extension_cost_is_what_allocate_takes() -> None:
    """The scheduler's reserve arithmetic: ``extension_cost`` equals the drop in free blocks, window
    recycling and blocks shared with another request included."""
    plan = build_plan(toy_specs(window=5, rate=2), 4, 4, 16, num_blocks=64)
    pools = BlockPoolSet(plan, "cpu")
    coord = KvCacheCoordinator(plan, pools)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 50) for _ in range(80)]
    coord.allocate("a", 0, 24)
    coord.publish("a", tokens, 24)
    hit = coord.probe(tokens[:30])
    assert hit.num_tokens == 24
    coord.admit_prefix("b", hit, tokens)
    ends = {"a": 24, "b": 24}
    for _ in range(40):
        rid = rng.choice(["a", "b", "c"])
        start = ends.get(rid, 0)
        end = start + rng.choice([1, 1, 1, 3, 7])
        free = {name: p.num_free for name, p in pools.pools.items()}
        cost = coord.extension_cost(rid, start, end)
        assert coord.allocate(rid, start, end)
        assert cost == {name: free[name] - p.num_free for name, p in pools.pools.items()}
        ends[rid] = end
