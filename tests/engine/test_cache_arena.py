"""The cache arena in the engine: long requests that a fixed split preempts run at once from one arena of
the same bytes, with the reference's tokens; its pages and each group's share in the engine's stats."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.plan import CachePlan, CachePlanError
from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.engine.worker.cache_plan import build_cache_plan
from hybridserve.models.deepseek_v4 import cache_specs
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from hybridserve.models.loader import read_config
from tests.proofs import prove_mismatch
from tests.reference import reference_greedy
from tests.tiny_models import VOCAB

BLOCK, PROMPT, NEW, N = 8, 40, 40, 4
ENGINE = dict(block_tokens=BLOCK, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)


def _plan(folder: Path, layout: str, memory: int) -> CachePlan:
    config = EngineConfig(
        model=str(folder), cache_layout=layout, kv_cache_memory=str(memory), **ENGINE, enforce_eager=True
    )
    cfg = DeepseekV4Config.from_dict(read_config(str(folder)))
    return build_cache_plan(config.cache_config, config.scheduler_config, cache_specs(cfg, torch.float32))


def _memory_where_only_the_arena_fits(folder: Path) -> int:
    """The least budget (in 4 KiB steps) at which the fixed split, whose window share is sized for
    max_num_seqs requests, holds two of the long requests at once; the arena then holds all of them."""
    tokens = PROMPT + NEW
    for memory in range(64 << 10, 16 << 20, 4 << 10):
        try:
            fixed = _plan(folder, "fixed", memory)
        except CachePlanError:  # not even the window share fits
            continue
        if fixed.requests_that_fit(tokens) >= 2:
            assert fixed.requests_that_fit(tokens) <= N // 2
            assert _plan(folder, "arena", memory).requests_that_fit(tokens) >= N
            return memory
    raise AssertionError("no budget found")


def _run(core: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens of every prompt, and the most requests that ran at once."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    requests = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    for r in requests:
        core.add_request(r)
    most = 0
    while core.has_unfinished_requests():
        core.step()
        most = max(most, core.snapshot().num_running)
    return [r.output_token_ids for r in requests], most


def test_long_requests_preempt_under_the_fixed_split_but_fit_in_the_arena(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    folder = tiny_checkpoint("mixed")
    memory = _memory_where_only_the_arena_fits(folder)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(N)]
    results = {}
    for layout in ("fixed", "arena"):
        llm = LLM(str(folder), cache_layout=layout, kv_cache_memory=str(memory), **ENGINE, enforce_eager=True)
        results[layout], most = _run(llm.engine, prompts)
        stats = llm.engine.snapshot()
        assert llm.engine.pools.all_free()
        llm.engine.pools.check_integrity()
        if layout == "fixed":
            assert stats.num_preemptions > 0 and stats.arena is None
        else:
            assert stats.num_preemptions == 0 and most == N, "the arena was meant to hold them all"
            assert stats.arena is not None and stats.arena.pages_free == stats.arena.pages_total
            assert all(p.pages == 0 for p in stats.kv_blocks.values())
    assert results["fixed"] == results["arena"]
    for prompt, ours in zip(prompts, results["arena"], strict=True):
        if ours != reference_greedy(folder, prompt, NEW):
            prove_mismatch(folder, prompt, ours)


def test_arena_stats_show_the_pages_each_group_holds(tiny_checkpoint: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_checkpoint("mixed")), kv_cache_memory="1MiB", **ENGINE, enforce_eager=True)
    core = llm.engine
    core.add_request(Request("a", list(range(3, 60)), SamplingParams(temperature=0, max_tokens=4)))
    core.step()
    stats = core.snapshot()
    a = stats.arena
    assert a is not None and core.plan.arena is not None
    assert a.page_bytes == core.plan.arena.page_bytes and a.pages_total == core.plan.arena.usable_pages
    held = {name: p.pages for name, p in stats.kv_blocks.items()}
    assert all(n > 0 for n in held.values()) and a.pages_free == a.pages_total - sum(held.values())
    core.abort_request("a")
    assert core.snapshot().arena.pages_free == a.pages_total  # type: ignore[union-attr]
