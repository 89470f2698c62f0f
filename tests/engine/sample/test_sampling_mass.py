"""top-k, top-p, min-p and temperature keep exactly the tokens and the mass a direct computation says,
and penalties move exactly the logits vLLM's definitions say, checked by hand-written arithmetic.

The filters follow vLLM: min-p on the tempered distribution, then top-k, then top-p on what top-k kept
(renormalised), keeping the token whose mass crosses p.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.sample.ops import filtered_probs
from hybridserve.engine.sample.sampler import Sampler

PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]
ORDER = [5, 2, 7, 0, 3, 6, 1, 4]  # token id of each entry of PROBS: rank is not id order
VOCAB = len(PROBS)


def _logits() -> torch.Tensor:
    row = torch.empty(VOCAB)
    for tok, p in zip(ORDER, PROBS, strict=True):
        row[tok] = math.log(p) + 1.7  # an offset softmax ignores
    return row


def _direct(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """The filtered, renormalised distribution over token ids, computed one token at a time."""
    tempered = {tok: p ** (1 / temperature) for tok, p in zip(ORDER, PROBS, strict=True)}
    total = sum(tempered.values())
    probs = {tok: w / total for tok, w in tempered.items()}
    best = max(probs.values())
    kept = [tok for tok in sorted(probs, key=probs.__getitem__, reverse=True) if probs[tok] >= min_p * best]
    if top_k > 0:
        kept = kept[:top_k]
    mass = sum(probs[t] for t in kept)
    nucleus, so_far = [], 0.0
    for tok in kept:
        nucleus.append(tok)
        so_far += probs[tok] / mass
        if so_far >= top_p:
            break
    kept_mass = sum(probs[t] for t in nucleus)
    return [probs[t] / kept_mass if t in nucleus else 0.0 for t in range(VOCAB)]


CASES = [
    dict(top_k=3),
    dict(top_p=0.5),
    dict(top_p=0.75),
    dict(min_p=0.3),
    dict(top_k=5, top_p=0.7),  # top-p over the top-5 mass keeps 3 tokens; over the whole mass it keeps 4
    dict(min_p=0.25, top_p=0.8, temperature=0.7),
    dict(temperature=1.5, top_k=4),
    dict(temperature=2.0),
]


@pytest.mark.parametrize("filters", CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filters_keep_the_direct_mass(filters: dict) -> None:
    params = SamplingParams(**({"temperature": 1.0} | filters))
    expected = torch.tensor(_direct(**filters))
    got = filtered_probs(_logits()[None], [Request("r", [0], params)])[0]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # the draws themselves: many rows of the same logits in one call, frequencies within 5 sigma
    n = 4000
    reqs = [Request(f"r{i}", [0], params) for i in range(n)]
    drawn = torch.tensor([r.token_id for r in Sampler(seed=7)(_logits().expand(n, VOCAB), reqs)])
    freq = torch.bincount(drawn, minlength=VOCAB).double() / n
    assert freq[expected == 0].sum() == 0, f"drew a filtered-out token: {freq}"
    sigma = (expected.double() * (1 - expected.double()) / n).sqrt()
    assert bool(((freq - expected.double()).abs() <= 5 * sigma + 1e-12).all()), (freq, expected)


def _penalised_request(**penalties: float) -> Request:
    req = Request("p", [0, 1], SamplingParams(temperature=1.0, **penalties))
    req.output_token_ids.extend([2, 2, 4, 3])
    return req


LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5, 0.9]
PENALTY_CASES = {
    # seen = prompt + output = {0, 1, 2, 3, 4}: positive logits / r, the rest * r; then, over the output
    # counts {2: 2, 3: 1, 4: 1}, minus frequency * count and presence once.
    "repetition_2_freq_pres": (
        dict(repetition_penalty=2.0, frequency_penalty=0.3, presence_penalty=0.5),
        [1.0, -2.0, 0.25 - 0.6 - 0.5, 1.5 - 0.3 - 0.5, -1.0 - 0.3 - 0.5, 0.9],
    ),
    "repetition_below_1": (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, 6.0, -0.25, 0.9]),
    "negative_freq_pres": (
        dict(frequency_penalty=-0.4, presence_penalty=-1.0),
        [2.0, -1.0, 0.5 + 0.8 + 1.0, 3.0 + 0.4 + 1.0, -0.5 + 0.4 + 1.0, 0.9],
    ),
}


@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_penalties_equal_the_arithmetic(case: str) -> None:
    penalties, expected = PENALTY_CASES[case]
    sampler = Sampler(seed=3)
    logits = torch.tensor([LOGITS])
    got = sampler.penalised(logits, [_penalised_request(**penalties)])[0]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)
    # the draws follow the softmax of the penalised logits, and greedy takes their argmax
    n = 3000
    reqs = [_penalised_request(**penalties) for _ in range(n)]
    drawn = torch.tensor([r.token_id for r in sampler(logits.expand(n, -1), reqs)])
    freq = torch.bincount(drawn, minlength=len(LOGITS)).double() / n
    want = torch.softmax(torch.tensor(expected, dtype=torch.float64), dim=0)
    assert bool(((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-12).all()), (freq, want)
    greedy = Request("g", [0, 1], SamplingParams(temperature=0, **penalties))
    greedy.output_token_ids.extend([2, 2, 4, 3])
    assert Sampler()(logits, [greedy])[0].token_id == max(range(len(expected)), key=expected.__getitem__)
