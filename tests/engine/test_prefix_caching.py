"""Prefix caching against a radix-tree oracle, and outputs identical to caching off."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.cache.coordinator import PrefixHit
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request
from tests.cache.radix_oracle import RadixOracle
from tests.tiny_models import VOCAB

BLOCK = 8
ARENA_BLOCKS = 9  # an arena of the bytes of 9 blocks of every group: evicts and reclaims across groups


def _workload(seed: int, n: int) -> list[list[int]]:
    """Shared prefixes of a few lengths, diverging inside blocks and exactly at block edges."""
    rng = random.Random(seed)
    roots = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([17, 24, 40, 61]))] for _ in range(4)]
    prompts = []
    for _ in range(n):
        root = rng.choice(roots)
        cut = rng.choice([len(root), 16, 24, rng.randrange(1, len(root) + 1)])
        prompts.append(root[:cut] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 12))])
    return prompts


def _run_with_oracle(
    core: EngineCore, prompts: list[list[int]], max_tokens: int, arrivals: int, reset_at: int
) -> list[list[int]]:
    """Feed prompts a few at a time; every prefix probe must find what the oracle says is reusable.
    The prefix cache is reset once, at step ``reset_at``, with requests running."""
    oracle = RadixOracle(core.coordinator.plan)
    oracle.watch(core.coordinator)
    probe = core.coordinator.probe
    probes: list[int] = []

    def checked_probe(tokens: list[int]) -> PrefixHit:
        expected = oracle.expected_hit(tokens)
        hit = probe(tokens)
        assert hit.num_tokens == expected, f"hit {hit.num_tokens}, oracle {expected}"
        probes.append(hit.num_tokens)
        return hit

    core.coordinator.probe = checked_probe  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    pending = list(requests)
    steps = 0
    while pending or core.has_unfinished_requests():
        for r in pending[:arrivals]:
            core.add_request(r)
        pending = pending[arrivals:]
        core.step()
        steps += 1
        if steps == reset_at:
            assert core.has_unfinished_requests()
            core.reset_prefix_cache()
            oracle.reset()
    assert len(probes) >= len(prompts) and sum(p > 0 for p in probes) >= 3
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize(
    ("num_blocks", "seqs", "layout"),
    [(None, 4, None), (20, 6, "fixed"), (ARENA_BLOCKS, 6, "arena")],
    ids=["roomy", "evicting", "evicting_arena"],
)
def test_hits_equal_the_radix_oracle_and_outputs_equal_caching_off(
    tiny_checkpoint: Callable[[str], Path], num_blocks: int | None, seqs: int, layout: str | None
) -> None:
    folder = str(tiny_checkpoint("mixed"))
    prompts = _workload(seed=3, n=24)
    kw = dict(
        block_tokens=BLOCK,
        max_num_seqs=seqs,
        max_num_batched_tokens=24,
        num_blocks=num_blocks,
        cache_layout=layout,
    )
    cached = LLM(folder, **kw, enforce_eager=True)
    got = _run_with_oracle(cached.engine, prompts, max_tokens=10, arrivals=3, reset_at=12)
    plain = LLM(folder, enable_prefix_caching=False, **kw, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert cached.engine.scheduler.prefix_hit_tokens > 0
    if layout == "fixed":  # the small pool evicts cached blocks and preempts running requests
        assert cached.engine.scheduler.num_preemptions > 0
    if layout == "arena":  # groups short of pages took back pages other groups kept for cached prefixes
        assert cached.engine.pools.arena is not None and cached.engine.pools.arena.num_reclaimed > 0
    cached.engine.reset_prefix_cache()
    assert cached.engine.pools.all_free() and all(
        p.num_cached == 0 for p in cached.engine.pools.pools.values()
    )
    cached.engine.pools.check_integrity()


@pytest.mark.parametrize("model_name", ["mixed", "csa_heavy"])
@pytest.mark.parametrize("seqs", [1, 16])
def test_greedy_with_caching_equals_without(
    tiny_checkpoint: Callable[[str], Path], model_name: str, seqs: int
) -> None:
    folder = str(tiny_checkpoint(model_name))
    prompts = _workload(seed=seqs, n=20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(block_tokens=BLOCK, max_num_seqs=seqs, max_num_batched_tokens=32)
    on = LLM(folder, **kw, enforce_eager=True)
    first = on.generate(prompts, params)
    second = on.generate(prompts, params)  # now mostly cached, including generated tokens
    off = LLM(folder, enable_prefix_caching=False, **kw, enforce_eager=True).generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].token_ids for o in first] == tokens
    assert [o.outputs[0].token_ids for o in second] == tokens
    # the second pass finds every full block of every prompt cached (at least one token is left to run)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
