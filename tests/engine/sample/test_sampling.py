"""Sampling parameters, stop conditions, logprobs and aborts, on a tiny random model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.core.engine_core import RequestRejected
from hybridserve.engine.request import Request, RequestOutput
from tests.reference import chunked_logits, reference_model
from tests.tiny_models import VOCAB

PROMPTS = [[5, 17, 99, 3, 250, 31], [7] * 11, list(range(40, 61))]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM(
        str(tiny_checkpoint("mixed")),
        block_tokens=8,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enforce_eager=True,
    )


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _tokens(llm.generate([PROMPTS[0]], params))[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    together = _tokens(llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others]))[1]
    assert alone == together
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate([PROMPTS[0]], other_seed))[0] != alone


@pytest.mark.parametrize(
    "params",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-6)],
    ids=["top_k=1", "top_p~0", "min_p=1", "temperature~0"],
)
def test_degenerate_filters_equal_greedy(llm: LLM, params: dict) -> None:
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, seed=3, **({"temperature": 1.0} | params))
    assert _tokens(llm.generate(PROMPTS, sampled)) == greedy


def test_huge_repetition_penalty_never_repeats(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1e6)
    for prompt, toks in zip(PROMPTS, _tokens(llm.generate(PROMPTS, params)), strict=True):
        assert len(set(toks)) == len(toks) and not set(toks) & set(prompt)


def test_logprobs_are_the_reference_log_softmax(llm: LLM, tiny_checkpoint: Callable[[str], Path]) -> None:
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    )[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    tokens = PROMPTS[2] + completion.token_ids
    ref = torch.log_softmax(
        chunked_logits(reference_model(tiny_checkpoint("mixed")), tokens, [len(tokens)]), -1
    )
    total = 0.0
    for step, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        expected = ref[len(PROMPTS[2]) - 1 + step]
        assert entry[tok].rank == 1 and len(entry) == 3
        assert entry[tok].logprob == pytest.approx(float(expected[tok]), abs=1e-4)
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        total += entry[tok].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free = _tokens(llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))[
        0
    ]
    stop_at = free[4]
    first = free.index(stop_at)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[
        0
    ]
    c = out.outputs[0]
    assert c.token_ids == free[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert c.token_ids == free[:3] and c.finish_reason == "length"


def test_eos_min_tokens_and_ignore_eos(llm: LLM) -> None:
    free = _tokens(llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))[
        0
    ]
    eos = free[2]
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = (eos,)
    try:
        stops = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
        assert stops.finish_reason == "stop" and stops.token_ids[-1] == eos and len(stops.token_ids) <= 3
        ignored = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert ignored[0].outputs[0].token_ids == free
        held = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, min_tokens=6))[0]
        assert eos not in held.outputs[0].token_ids[:6]
    finally:
        llm.engine.eos_token_ids = saved


def test_stop_strings_end_the_text_before_them(llm: LLM) -> None:
    assert llm.tokenizer is not None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = llm.generate(["It is a truth"], params)[0].outputs[0].text
    stop = free[6:9]
    assert len(free) > 12 and stop
    cut = llm.generate(["It is a truth"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ].outputs[0]
    assert cut.text == free[: free.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate(["It is a truth"], kept)[0].outputs[0].text == free[: free.index(stop) + len(stop)]


def test_abort_frees_blocks_and_reports_abort(llm: LLM) -> None:
    core = llm.engine
    req = Request("to-abort", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=50))
    core.add_request(req)
    for _ in range(3):
        core.step()
    assert not core.pools.all_free()
    assert core.abort_request("to-abort")
    assert req.finish_reason is not None and req.finish_reason.value == "abort"
    assert core.pools.all_free() and not core.has_unfinished_requests()
    core.pools.check_integrity()


def test_requests_that_can_never_fit_are_rejected_with_numbers(llm: LLM) -> None:
    limit = llm.engine.max_request_tokens
    with pytest.raises(RequestRejected, match=r"holds at most [\d,]+ per request"):
        llm.generate([[5] * (limit - 3)], SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="token ids must be in"):
        llm.generate([[VOCAB + 5]], SamplingParams(max_tokens=1))
    assert llm.engine.pools.all_free()


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(logprobs=50),
        dict(stop=[""]),
    ],
)
def test_invalid_sampling_params_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
