"""Rejection sampling draws exactly from the target distribution, whatever the drafter proposes.

A small vocabulary, drafts drawn from a deliberately different distribution q, thousands of requests
verified in one call; the emitted tokens are compared by a chi-square test with the target distribution
computed here from its definition (temperature, top-k / top-p / min-p, presence and frequency penalties
over the outputs plus the accepted drafts). Fixed seeds: the outcome is deterministic, never a flake.
"""

from __future__ import annotations

from collections import Counter

import torch

from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.sample.rejection_sampler import RejectionSampler
from hybridserve.engine.sample.sampler import Sampler

V = 8
N = 4000
K = 2


def _chi2_pvalue(counts: Counter[int], probs: torch.Tensor) -> float:
    """P-value of the observed ``counts`` under ``probs``; any count on a zero-probability token fails."""
    n = sum(counts.values())
    assert all(probs[t] > 0 for t in counts), f"drew a token the target excludes: {counts}"
    support = (probs > 0).nonzero().flatten().tolist()
    stat = sum((counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support)
    df = torch.tensor((len(support) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def _target(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """The plain sampler's distribution, written from its definition."""
    x = logits.clone().double()
    for t in set(history):
        x[t] -= p.presence_penalty + p.frequency_penalty * history.count(t)
    probs = torch.softmax(x / p.temperature, dim=-1)
    if p.min_p:
        probs[probs < p.min_p * probs.max()] = 0
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    kept_by_top_k = order[: p.top_k] if p.top_k else order
    total, cum = float(probs[kept_by_top_k].sum()), 0.0  # top-p measures the mass top-k kept (vLLM)
    for rank, t in enumerate(order.tolist()):
        if (p.top_k and rank >= p.top_k) or (rank and cum > p.top_p * total):
            break
        keep[t], cum = True, cum + float(probs[t])
    probs = probs * keep
    return probs / probs.sum()


def _run(params: SamplingParams, outputs: list[int], seed: int) -> tuple[list[list[int]], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    # The drafter: related to the target but visibly off (other tokens, no top-k, no penalties).
    q = torch.softmax(logits[:K] + torch.randn(K, V, generator=g), dim=-1)
    requests = []
    for i in range(N):
        req = Request(str(i), [1, 2], params, output_token_ids=list(outputs))
        req.spec_token_ids = torch.multinomial(q, 1, generator=g).flatten().tolist()
        req.spec_probs = q
        requests.append(req)
    sampler = RejectionSampler(Sampler(seed))
    verified = sampler.verify(logits.repeat(N, 1), requests, [K] * N)
    return [[r.token_id for r in v.results] for v in verified], logits


def test_emitted_tokens_follow_the_target_with_top_k_and_temperature() -> None:
    params = SamplingParams(temperature=0.8, top_k=5)
    runs, logits = _run(params, [], seed=0)
    assert 0 < sum(len(r) - 1 for r in runs) < K * N  # some drafts accepted, some rejected
    for pos in range(K + 1):
        counts = Counter(r[pos] for r in runs if len(r) > pos)
        assert sum(counts.values()) > 300
        assert _chi2_pvalue(counts, _target(logits[pos], params, [])) > 1e-4, (pos, counts)


def test_penalties_and_filters_apply_to_both_distributions() -> None:
    params = SamplingParams(
        temperature=1.2, top_p=0.85, min_p=0.05, presence_penalty=1.0, frequency_penalty=0.5
    )
    outputs = [3, 3, 5]
    runs, logits = _run(params, outputs, seed=1)
    first = Counter(r[0] for r in runs)
    assert _chi2_pvalue(first, _target(logits[0], params, outputs)) > 1e-4
    # The second token given an accepted first draft x follows the target with x counted as an output.
    x, _ = Counter(r[0] for r in runs if len(r) > 1).most_common(1)[0]
    second = Counter(r[1] for r in runs if len(r) > 1 and r[0] == x)
    assert sum(second.values()) > 300
    assert _chi2_pvalue(second, _target(logits[1], params, [*outputs, x])) > 1e-4


def test_plain_sampling_and_speculative_sampling_agree() -> None:
    """The first emitted token against the plain sampler's own draws from the same logits."""
    params = SamplingParams(temperature=0.8, top_k=5)
    runs, logits = _run(params, [], seed=2)
    plain = Sampler(7)
    requests = [Request(f"p{i}", [1, 2], params) for i in range(N)]
    drawn = Counter(r.token_id for r in plain(logits[:1].repeat(N, 1), requests))
    spec = Counter(r[0] for r in runs)
    pooled = torch.tensor([drawn.get(t, 0) + spec.get(t, 0) for t in range(V)], dtype=torch.float64)
    # Two-sample test: each sample against the pooled estimate.
    assert _chi2_pvalue(spec, pooled / pooled.sum()) > 1e-4
    assert _chi2_pvalue(drawn, pooled / pooled.sum()) > 1e-4


def test_seeded_requests_are_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    first, _ = _run(params, [], seed=3)
    again, _ = _run(params, [], seed=3)
    assert first == again


def test_greedy_takes_the_longest_matching_prefix_and_the_bonus() -> None:
    logits = torch.full((4, V), -5.0)
    best = [4, 6, 1, 2]
    for row, t in enumerate(best):
        logits[row, t] = 5.0
    sampler = RejectionSampler(Sampler(0))
    cases = {(4, 6, 1): [4, 6, 1, 2], (4, 7, 1): [4, 6], (0, 6, 1): [4]}
    for drafts, expected in cases.items():
        req = Request("g", [1], SamplingParams(temperature=0))
        req.spec_token_ids = list(drafts)
        (v,) = sampler.verify(logits, [req], [3])
        assert [r.token_id for r in v.results] == expected
        assert v.num_accepted == len(expected) - 1
