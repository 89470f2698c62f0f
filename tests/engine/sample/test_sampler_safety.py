"""The sampler survives any parameters SamplingParams accepts, on any logits, without NaN or crashes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.sample.ops import SampleResult, filtered_probs
from hybridserve.engine.sample.sampler import Sampler

INF = float("inf")
EXTREMES = [1e30, -1e30, 3e38, -3e38, -INF, INF, float("nan"), 0.0]


def _request(
    params: SamplingParams, prompt: Sequence[int], output: Sequence[int] = (), eos: tuple[int, ...] = ()
) -> Request:
    req = Request("r", list(prompt), params)
    req.eos_token_ids = eos
    req.output_token_ids.extend(output)
    return req


def _sample(logits: list[list[float]] | torch.Tensor, *reqs: Request) -> list[SampleResult]:
    return Sampler(seed=0)(torch.as_tensor(logits, dtype=torch.float32), list(reqs))


def _check(results: list[SampleResult], reqs: list[Request], vocab: int) -> None:
    assert len(results) == len(reqs)
    for res, req in zip(results, reqs, strict=True):
        assert 0 <= res.token_id < vocab
        if req.params.logprobs is None:
            assert res.top is None
            continue
        assert res.top is not None and res.token_id in res.top
        assert len(res.top) <= min(req.params.logprobs, vocab) + 1
        for tid, lp in res.top.items():
            assert 0 <= tid < vocab and lp.rank >= 1
            assert math.isfinite(lp.logprob) or lp.logprob == -INF


def _ids(vocab: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, vocab - 1), st.integers(-3, vocab + 3), st.integers(-(2**70), 2**70))


@st.composite
def _params(draw: st.DrawFn, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(1e-8, 1e-3), st.floats(0, 2))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0, 1, exclude_min=True))),
        top_k=draw(st.one_of(st.sampled_from([-1, 0]), st.integers(1, vocab + 5))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0, 1))),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(
            st.one_of(st.sampled_from([1.0, 1e-300, 5e-324, 1e300, INF]), st.floats(1e-300, 1e300))
        ),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
        max_tokens=None,
        min_tokens=draw(st.integers(0, 4)),
        stop_token_ids=draw(st.lists(_ids(vocab), max_size=4)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
    )


@st.composite
def _batch(draw: st.DrawFn) -> tuple[torch.Tensor, list[Request]]:
    vocab = draw(st.integers(1, 24))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        value = st.one_of(st.floats(-50, 50), st.sampled_from(EXTREMES))
        row = (
            [-INF] * vocab
            if draw(st.booleans()) and draw(st.booleans())
            else draw(st.lists(value, min_size=vocab, max_size=vocab))
        )
        rows.append(row)
    reqs = [
        _request(
            draw(_params(vocab)),
            draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)),
            draw(st.lists(st.integers(0, vocab - 1), max_size=6)),
            tuple(draw(st.lists(_ids(vocab), max_size=2))),
        )
        for _ in rows
    ]
    return torch.tensor(rows, dtype=torch.float32), reqs


@settings(max_examples=150, deadline=None)
@given(_batch())
def test_any_accepted_params_never_crash_or_give_nan(batch: tuple[torch.Tensor, list[Request]]) -> None:
    logits, reqs = batch
    _check(Sampler(seed=0)(logits, reqs), reqs, logits.shape[1])


def _one(logits: list[float], prompt: Sequence[int] = (0,), **kw: Any) -> SampleResult:
    output = kw.pop("output", [])
    eos = kw.pop("eos", ())
    req = _request(SamplingParams(**({"seed": 7} | kw)), prompt, output, eos)
    res = _sample([logits], req)
    _check(res, [req], len(logits))
    return res[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_repetition_penalty_boosts_seen_positive_logits(temperature: float) -> None:
    res = _one([1.0, 2.0, 0.0, -1.0], prompt=[0], repetition_penalty=1e-300, temperature=temperature)
    assert res.token_id == 0


@pytest.mark.parametrize("penalty", [1e300, INF])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_huge_repetition_penalty_on_zero_logit_is_not_nan(penalty: float, temperature: float) -> None:
    res = _one([0.0, 2.0, -1.0, -30.0], [0, 1, 2], repetition_penalty=penalty, temperature=temperature)
    assert res.token_id in (0, 1)


@pytest.mark.parametrize("temperature", [1e-5, 1e-4, 1e-3])
def test_tiny_temperature_with_huge_logits_picks_the_best(temperature: float) -> None:
    assert _one([1e36, 0.0, -1e36, 3e38 / 2], temperature=temperature).token_id == 3


def test_tiny_temperature_with_penalties_picks_the_best() -> None:
    res = _one(
        [3e35, 3e35, -3e35, 1.0],
        output=[0, 0, 3],
        temperature=1e-4,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        repetition_penalty=1.5,
    )
    assert res.token_id in (0, 1)


def test_top_k_and_logprobs_beyond_the_vocabulary() -> None:
    res = _one([0.5, 0.1], top_k=1000, top_p=0.9, logprobs=20)
    assert res.top is not None and sorted(res.top) == [0, 1]
    assert _one([3.0], top_k=5, logprobs=20, temperature=1.0).token_id == 0


def test_out_of_range_stop_ids_ban_nothing_else() -> None:
    res = _one(
        [0.0, 1.0, 5.0], min_tokens=3, stop_token_ids=[-1, 3, 10**6, 2**80], eos=(-2, 99), temperature=0
    )
    assert res.token_id == 2


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_min_tokens_banning_everything_falls_back_to_the_model_best(temperature: float) -> None:
    res = _one([0.0, 4.0, 1.0], min_tokens=2, stop_token_ids=[0, 1], eos=(2,), temperature=temperature)
    assert res.token_id == 1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_repetition_penalty_keeps_banned_ids_banned(temperature: float) -> None:
    """Every id is both seen and banned: the penalty must not turn a ban (-inf) into a finite logit."""
    res = _one(
        [0.0, 4.0, 1.0],
        [0, 1, 2],
        min_tokens=2,
        stop_token_ids=[0, 1],
        eos=(2,),
        repetition_penalty=3e38,
        temperature=temperature,
    )
    assert res.token_id == 1


@pytest.mark.parametrize("filters", [dict(min_p=1.0), dict(top_p=1e-9), dict(top_k=1)])
def test_filters_that_keep_almost_nothing_keep_the_best(filters: dict[str, Any]) -> None:
    assert _one([1.0, 1e30, -INF, 2.0], temperature=1e-3, **filters).token_id == 1


def test_all_minus_inf_row_gives_a_token_and_minus_inf_logprobs() -> None:
    res = _one([-INF] * 4, temperature=1.0, logprobs=2)
    assert res.top is not None and all(lp.logprob == -INF for lp in res.top.values())


def test_greedy_is_the_argmax_and_ordinary_probs_are_the_tempered_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    reqs = [_request(SamplingParams(temperature=0), [1, 2]) for _ in range(3)]
    assert [r.token_id for r in Sampler()(logits, reqs)] == logits.argmax(-1).tolist()
    reqs = [_request(SamplingParams(temperature=t), [1]) for t in (0.3, 1.0, 1.7)]
    expected = torch.softmax(logits / torch.tensor([0.3, 1.0, 1.7])[:, None], dim=-1)
    torch.testing.assert_close(filtered_probs(logits, reqs), expected)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([-INF, -2.0, 0.0, 1.0, 3e38, INF]), min_size=9, max_size=9),
        min_size=1,
        max_size=6,
    )
)
def test_greedy_takes_the_first_of_equal_maxima(rows: list[list[float]]) -> None:
    """Greedy is torch's argmax (the first of tied maxima) of the finite logits, however it is computed."""
    reqs = [_request(SamplingParams(temperature=0.0), [3]) for _ in rows]
    logits = torch.tensor(rows)
    expected = torch.nan_to_num(logits, posinf=torch.finfo(torch.float32).max).argmax(dim=-1).tolist()
    assert [r.token_id for r in _sample(logits, *reqs)] == expected
