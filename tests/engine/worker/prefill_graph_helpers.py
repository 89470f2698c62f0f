"""Helpers for the prefill-graph tests: engines, prompts and the eager-vs-compiled check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.llm import LLM
from hybridserve.engine.request import RequestOutput, SamplingParams
from hybridserve.engine.worker.prefill_graphs import PrefillGraphRunner
from tests.tiny_models import VOCAB

# Compiled steps pick query blocks of 2 or more and pad compressed reads: other matmul groupings than the
# eager steps', so logprobs agree to float32 rounding, not bit for bit.
ATOL = 1e-4
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Every runner's graph is cached on the one code object of ``prefill_graphs.prefill_step``: earlier
    tests' entries would count against dynamo's recompile limit, past which it runs frames eagerly."""
    torch._dynamo.reset()


def graph_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def graph_llm(checkpoint: Path, compiled: bool, **kwargs: int | str) -> LLM:
    """The offline engine, 48-token steps (chunked prompts beside decodes); compiled: the prefill graph
    only (decode steps eager), on the fixed cache layout unless ``cache_layout`` says otherwise."""
    common = dict(block_tokens=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256)
    common |= dict(cache_layout="fixed")
    if compiled:
        return LLM(str(checkpoint), compile_prefill=True, compile_decode=False, **{**common, **kwargs})
    return LLM(str(checkpoint), enforce_eager=True, **{**common, **kwargs})


def null_rows_zero(pools: BlockPoolSet) -> bool:
    return not any(rows.any() for rows in pools.null_rows())


def assert_close(plain: list[RequestOutput], compiled: list[RequestOutput]) -> None:
    """Same greedy tokens; sampled and prompt logprobs equal to float32 rounding."""
    for a, b in zip(plain, compiled, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True))
        pairs += [(x, y) for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True) if x]
        assert pairs
        for x, y in pairs:
            assert y is not None and x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= ATOL for t in x)


def prefill_runner(llm: LLM) -> PrefillGraphRunner:
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None
    return graphs
