"""The batched sampler equals a plain per-row reference, keeps seeded draws independent of the batch,
draws from the right distribution, and keeps its per-request token history in step with the requests."""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence

import pytest
import torch

from hybridserve.engine.request import FinishReason, Logprob, Request, SamplingParams
from hybridserve.engine.sample.ops import SampleResult
from hybridserve.engine.sample.sampler import Sampler

F32 = torch.finfo(torch.float32)
INF = float("inf")


# ---- a per-row reference: the sampler as it was before batching, plus the documented draw rule ----------
def _in_vocab(ids: Sequence[int], vocab: int) -> list[int]:
    return [t for t in ids if 0 <= t < vocab]


def _ref_penalised(row: torch.Tensor, req: Request) -> torch.Tensor:
    row = row.clone()
    p, vocab = req.params, row.shape[0]
    if len(req.output_token_ids) < p.min_tokens:
        eos = () if p.ignore_eos else req.eos_token_ids
        banned = _in_vocab([*p.stop_token_ids, *eos], vocab)
        if banned:
            row[banned] = -INF
    if p.repetition_penalty != 1.0:
        idx = torch.tensor(sorted(set(_in_vocab(req.all_token_ids, vocab))), dtype=torch.long)
        penalty = min(max(p.repetition_penalty, F32.tiny), F32.max)
        vals = row[idx]
        scaled = torch.where(vals > 0, vals / penalty, vals * penalty).clamp(F32.min, F32.max)
        row[idx] = torch.where(torch.isneginf(vals), vals, scaled)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        out = torch.tensor(_in_vocab(req.output_token_ids, vocab), dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _ref_weights(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    vocab = row.shape[0]
    temp = torch.tensor([min(p.temperature, F32.max)], dtype=torch.float32)
    probs = torch.softmax((row - row.max())[None] / temp[:, None], dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
    top_k = min(p.top_k, vocab) if p.top_k > 0 else vocab
    if top_k < vocab or p.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None]
        sorted_p = sorted_p.masked_fill(ranks >= top_k, 0)
        cum = sorted_p.cumsum(dim=-1)
        top_p = torch.tensor([p.top_p], dtype=torch.float32)
        drop = (cum - sorted_p) > top_p[:, None] * cum[:, -1:]
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0))
    return probs[0]


def _ref_draw(weights: torch.Tensor, u: float) -> int:
    cum = weights.double().cumsum(dim=0)
    total = cum[-1:]
    x = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return int(torch.searchsorted(cum, x, right=True))


def _ref_top(raw: torch.Tensor, token: int, n: int) -> dict[int, Logprob]:
    top = {token: Logprob(float(raw[token]), int((raw > raw[token]).sum()) + 1)}
    values, ids = raw.topk(min(n, raw.shape[0]))
    for rank, (tid, val) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
        top.setdefault(tid, Logprob(val, rank))
    return top


def reference(row: torch.Tensor, req: Request) -> tuple[int | None, torch.Tensor | None]:
    """(token, None) for a greedy or seeded row (drawing from ``req.generator``); (None, weights) else."""
    logits = torch.nan_to_num(row.float(), nan=-INF, posinf=F32.max, neginf=-INF)
    penalised = _ref_penalised(logits, req)
    best = int((logits if bool(torch.isneginf(penalised.max())) else penalised).argmax())
    if req.params.greedy:
        return best, None
    weights = _ref_weights(penalised, req.params)
    if not (bool(torch.isfinite(weights).all()) and float(weights.sum()) > 0):
        weights = torch.nn.functional.one_hot(torch.tensor(best), row.shape[0]).float()
    if req.generator is None:
        return None, weights
    return _ref_draw(weights, float(torch.rand((), generator=req.generator, dtype=torch.float64))), weights


def reference_top(row: torch.Tensor, req: Request, token: int) -> dict[int, Logprob] | None:
    if req.params.logprobs is None:
        return None
    logits = torch.nan_to_num(row.float(), nan=-INF, posinf=F32.max, neginf=-INF)
    raw = torch.nan_to_num(torch.log_softmax(logits, dim=-1), nan=-INF, posinf=F32.max, neginf=-INF)
    return _ref_top(raw, token, req.params.logprobs)


# ---- helpers ----------------------------------------------------------------------------------------------
def _twins(
    rid: str, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]
) -> tuple[Request, Request]:
    """Two equal requests with separate generators: one for the sampler, one for the reference."""
    pair = (Request(rid, list(prompt), params), Request(rid, list(prompt), params))
    for r in pair:
        r.eos_token_ids = eos
    return pair


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    penalties = rng.random() < 0.6
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.5, 1.0, 1.3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        top_k=rng.choice([0, 0, 3, vocab + 2]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7, 1e30]) if penalties else 1.0,
        presence_penalty=rng.choice([0.0, 0.5, -1.0]) if penalties else 0.0,
        frequency_penalty=rng.choice([0.0, 0.3, -0.2]) if penalties else 0.0,
        seed=rng.choice([None, rng.randrange(2**32)]),
        max_tokens=None,
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=[*rng.sample(range(vocab), 2), vocab + 7],
        ignore_eos=rng.random() < 0.3,
        logprobs=rng.choice([None, None, 0, 3]),
    )


def _logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 3
    specials = torch.tensor([-INF, INF, float("nan"), 3e38, -3e38])
    mask = torch.rand(rows, vocab, generator=gen) < 0.03
    picks = specials[torch.randint(0, len(specials), (rows, vocab), generator=gen)]
    return torch.where(mask, picks, x)


# ---- tests -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", range(4))
def test_matches_the_per_row_reference_over_many_steps(case: int) -> None:
    """Bans, penalties from an incremental history, greedy and seeded tokens and logprobs equal the
    reference exactly, while requests come and go, sit out steps (preempted) and have tails cut."""
    rng, gen, vocab = random.Random(case), torch.Generator().manual_seed(case), 48
    sampler = Sampler(seed=case)
    pool: list[tuple[Request, Request]] = []
    for step in range(40):
        while len(pool) < 10:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            eos = tuple(rng.sample(range(vocab), rng.randrange(0, 2)))
            pool.append(_twins(f"r{step}-{len(pool)}", prompt, _random_params(rng, vocab), eos))
        batch = [pair for pair in pool if rng.random() < 0.7] or pool[:1]
        logits = _logits(gen, len(batch), vocab)
        results = sampler(logits, [ours for ours, _ in batch])
        for row, res, (ours, ref) in zip(logits, results, batch, strict=True):
            _check_row(row, res, ref)
            for r in (ours, ref):
                r.output_token_ids.append(res.token_id)
        _churn(rng, pool)


def _check_row(row: torch.Tensor, res: SampleResult, ref: Request) -> None:
    token, weights = reference(row, ref)
    if token is not None:
        assert res.token_id == token
    else:
        assert weights is not None and float(weights[res.token_id]) > 0
    assert res.top == reference_top(row, ref, res.token_id)


def _churn(rng: random.Random, pool: list[tuple[Request, Request]]) -> None:
    """Finish some requests (dropping them) and cut the tail of others' outputs (a rollback)."""
    for pair in list(pool):
        if rng.random() < 0.08:
            pair[0].finish(FinishReason.STOP)
            pool.remove(pair)
        elif rng.random() < 0.1 and pair[0].output_token_ids:
            cut = rng.randrange(len(pair[0].output_token_ids))
            for r in pair:
                del r.output_token_ids[cut:]


def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch() -> None:
    vocab, steps = 64, 12
    gen = torch.Generator().manual_seed(5)
    own_rows = torch.randn(steps, vocab, generator=gen) * 2
    params = SamplingParams(
        temperature=1.1, top_p=0.9, seed=99, repetition_penalty=1.2, frequency_penalty=0.3
    )

    def run(others: int, position: int, sampler_seed: int) -> list[int]:
        rng = random.Random(others * 31 + position)
        sampler = Sampler(seed=sampler_seed)
        req = Request("seeded", [1, 2, 3], params)
        mates = [Request(f"o{i}", [4, 5], _random_params(rng, vocab)) for i in range(others)]
        tokens = []
        for step in range(steps):
            logits = torch.randn(others + 1, vocab, generator=gen) * 3
            batch = [*mates]
            batch.insert(position, req)
            logits[position] = own_rows[step]
            results = sampler(logits, batch)
            for r, res in zip(batch, results, strict=True):
                r.output_token_ids.append(res.token_id)
            tokens.append(results[position].token_id)
        return tokens

    alone = run(0, 0, sampler_seed=0)
    assert len(set(alone)) > 1
    for others, position, sampler_seed in [(1, 0, 1), (5, 3, 2), (20, 20, 3), (7, 0, 4)]:
        assert run(others, position, sampler_seed) == alone


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_filtered_distribution(seeded: bool) -> None:
    """Many rows of the same logits, in one call: token frequencies match the reference probabilities."""
    n, vocab = 6000, 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -INF, 3.0]]).expand(n, vocab)
    params = [
        SamplingParams(temperature=0.8, top_k=6, top_p=0.97, min_p=0.02, seed=i if seeded else None)
        for i in range(n)
    ]
    reqs = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    counts = torch.bincount(
        torch.tensor([r.token_id for r in Sampler(seed=1)(logits, reqs)]), minlength=vocab
    ).double()
    expected = _ref_weights(logits[0], params[0]).double()
    expected /= expected.sum()
    assert counts[expected == 0].sum() == 0
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((counts / n - expected).abs() <= 5 * sigma + 1e-12).all()), (counts / n, expected)


def test_greedy_batch_is_the_argmax_with_nan_as_minus_inf() -> None:
    logits = torch.tensor([[0.0, float("nan"), 1.0], [float("nan")] * 3, [INF, 2.0, INF]])
    reqs = [Request(f"g{i}", [0], SamplingParams(temperature=0)) for i in range(3)]
    assert [r.token_id for r in Sampler()(logits, reqs)] == [2, 0, 0]


def test_history_rows_are_reused_after_requests_finish_or_vanish() -> None:
    sampler = Sampler()
    history = sampler.history
    params = SamplingParams(temperature=0, repetition_penalty=1e6)
    logits = torch.full((1, 8), 0.5)
    logits[0, 3] = 1.0
    first = Request("a", [3], params)
    assert sampler(logits, [first])[0].token_id != 3
    assert len(history.by_request) == 1
    first.finish(FinishReason.STOP)
    again = Request("a", [5], params)  # same id, new request: the old history must not leak into it
    assert sampler(logits, [again])[0].token_id == 3
    assert len(history.by_request) == 1 and history.all_counts.shape[0] == 8
    del again
    gc.collect()
    sampler(logits, [Request("b", [0], SamplingParams(temperature=0))])
    assert not history.by_request and len(history.free) == 8


def test_outputs_cut_or_rewritten_between_calls_are_recounted() -> None:
    sampler = Sampler()
    history = sampler.history
    req = Request("r", [3], SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0))
    req.output_token_ids.extend([1, 1, 2])
    logits = torch.tensor([[0.0, 10.0, 7.0, 0.0]])

    def counts() -> tuple[list[int], list[int]]:
        row = history.by_request[id(req)].index
        return history.output_counts[row].tolist(), history.all_counts[row].tolist()

    assert sampler(logits, [req])[0].token_id == 1  # 10 - 2*2 - 2 = 4 > 7 - 2 - 2 = 3
    assert counts() == ([0, 2, 1, 0], [0, 2, 1, 1])
    del req.output_token_ids[1:]  # a rollback to [1]: 10 - 4 = 6 < 7
    assert sampler(logits, [req])[0].token_id == 2
    assert counts() == ([0, 1, 0, 0], [0, 1, 0, 1])
    req.output_token_ids[0] = 2  # rewritten in place to [2]; the last counted id differs: a rebuild
    assert sampler(logits, [req])[0].token_id == 1
    assert counts() == ([0, 0, 1, 0], [0, 0, 1, 1])
    req.output_token_ids.extend([0, 0, 1])
    sampler(logits, [req])
    assert counts() == ([2, 1, 1, 0], [2, 1, 1, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_greedy_matches_the_cpu_and_seeds_ignore_the_batch() -> None:
    vocab = 4096
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, vocab, generator=gen) * 3
    greedy = [Request(f"g{i}", [i, i + 1], SamplingParams(temperature=0)) for i in range(16)]
    on_cpu = [r.token_id for r in Sampler()(logits, greedy)]
    on_gpu = [r.token_id for r in Sampler()(logits.cuda(), greedy)]
    assert on_cpu == on_gpu
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, repetition_penalty=1.3)
    runs = []
    for size in (1, 16):
        req = Request("s", [7, 8, 9], params)
        sampler, tokens = Sampler(seed=size), []
        for _ in range(8):
            batch = torch.randn(size, vocab, generator=gen).cuda() * 3
            batch[0] = logits[0].cuda()
            others = [Request(f"o{i}", [1], SamplingParams(temperature=1.0)) for i in range(size - 1)]
            tok = sampler(batch, [req, *others])[0].token_id
            req.output_token_ids.append(tok)
            tokens.append(tok)
        runs.append(tokens)
    assert runs[0] == runs[1]
