"""``max_tokens = 1``: one token, the reference's first greedy token, finish reason "length", with and
without a prefix hit, and with the model's chunked sink-attention branch forced on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.layers import attention
from tests.engine.test_greedy_vs_reference import _prompts
from tests.reference import reference_greedy


def test_max_tokens_one_is_the_reference_first_token(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    llm = LLM(str(folder), block_tokens=8, max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True)
    prompts = _prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):  # the second pass resumes from cached prefixes
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            c = out.outputs[0]
            assert c.token_ids == reference_greedy(folder, prompt, 1) and c.finish_reason == "length"
    assert sum(o.num_cached_tokens for o in outs) > 0
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=1, seed=1))
    assert all(len(o.outputs[0].token_ids) == 1 for o in sampled)
    assert llm.engine.pools.all_free()


def test_greedy_with_chunked_sink_attention_equals_the_reference(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score budget of one key row per chunk forces the chunked branch in every attention call."""
    monkeypatch.setattr(attention, "_MAX_SCORE_ELEMENTS", 1)
    folder = tiny_checkpoint("mixed")
    llm = LLM(str(folder), block_tokens=8, max_num_seqs=4, max_num_batched_tokens=24, enforce_eager=True)
    prompts = _prompts(3, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [reference_greedy(folder, p, 8) for p in prompts]
