"""Token selection: penalties, greedy / temperature / top-k / top-p / min-p, per-request seeds, logprobs.

Any parameters that SamplingParams accepts are numerically safe here: penalties stay finite, banned or
out-of-vocabulary ids never crash, and a row with nothing left to draw from falls back to its best token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridserve.engine.request import Logprob, Request

_F32 = torch.finfo(torch.float32)
_NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_id: int
    top: dict[int, Logprob] | None  # the chosen token and the top n, when logprobs were asked for


class Sampler:
    """Samples one token per row of ``logits`` for the matching request.

    Logprobs are those of the raw model distribution (before penalties and temperature), as vLLM
    reports by default. A request with a seed draws from its own generator, so its tokens do not
    depend on what else is in the batch.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        logits = _finite(logits.float())
        raw = (
            _finite(torch.log_softmax(logits, dim=-1))
            if any(r.params.logprobs is not None for r in requests)
            else None
        )
        penalised = logits.clone()
        for i, req in enumerate(requests):
            _apply_min_tokens(penalised[i], req)
            _apply_penalties(penalised[i], req)
        tokens = self._choose(penalised, _best_tokens(penalised, logits), requests)
        return [
            _result(tok, raw[i] if raw is not None else None, req)
            for i, (tok, req) in enumerate(zip(tokens, requests, strict=True))
        ]

    def _choose(self, logits: torch.Tensor, best: list[int], requests: list[Request]) -> list[int]:
        tokens = list(best)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not random_rows:
            return tokens
        probs = _filtered_probs(logits[random_rows].cpu(), [requests[i] for i in random_rows])
        probs = _or_one_hot(probs, torch.tensor([best[i] for i in random_rows], dtype=torch.long))
        unseeded = [j for j, i in enumerate(random_rows) if requests[i].generator is None]
        if unseeded:
            drawn = torch.multinomial(probs[unseeded], 1, generator=self.generator).flatten().tolist()
            for j, tok in zip(unseeded, drawn, strict=True):
                tokens[random_rows[j]] = tok
        for j, i in enumerate(random_rows):
            gen = requests[i].generator
            if gen is not None:
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen))
        return tokens


def _finite(x: torch.Tensor) -> torch.Tensor:
    """NaN becomes -inf (never chosen), +inf the largest float; -inf stays, as it marks a ban."""
    return torch.nan_to_num(x, nan=_NEG_INF, posinf=_F32.max, neginf=_NEG_INF)


def _in_vocab(ids: Iterable[int], vocab: int) -> list[int]:
    return [t for t in ids if 0 <= t < vocab]


def _apply_min_tokens(row: torch.Tensor, req: Request) -> None:
    if len(req.output_token_ids) < req.params.min_tokens:
        eos = () if req.params.ignore_eos else req.eos_token_ids
        banned = _in_vocab([*req.params.stop_token_ids, *eos], row.shape[0])
        if banned:
            row[banned] = _NEG_INF


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = sorted(set(_in_vocab(req.all_token_ids, vocab)))
        idx = torch.tensor(seen, dtype=torch.long, device=row.device)
        row[idx] = _repetition_penalised(row[idx], p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        out = torch.tensor(_in_vocab(req.output_token_ids, vocab), dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _repetition_penalised(vals: torch.Tensor, penalty: float) -> torch.Tensor:
    # In float32 a penalty of 1e-300 is 0 and one of 1e300 is inf, and either makes 0 * inf = NaN.
    penalty = min(max(penalty, _F32.tiny), _F32.max)
    scaled = torch.where(vals > 0, vals / penalty, vals * penalty).clamp(_F32.min, _F32.max)
    return torch.where(torch.isneginf(vals), vals, scaled)


def _best_tokens(penalised: torch.Tensor, logits: torch.Tensor) -> list[int]:
    """Argmax of the penalised logits, or of the model's own where every token was banned."""
    all_banned = torch.isneginf(penalised.amax(dim=-1, keepdim=True))
    return torch.where(all_banned, logits, penalised).argmax(dim=-1).tolist()


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    vocab = logits.shape[1]
    temps = torch.tensor([min(r.params.temperature, _F32.max) for r in requests], dtype=logits.dtype)
    # With the best logit at 0, dividing by a tiny temperature can only underflow, never overflow.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temps[:, None], dim=-1)
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0)
    top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in requests]
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=logits.dtype)
    if min(top_k) < vocab or bool((top_p < 1).any()):
        probs = _top_k_top_p(probs, torch.tensor(top_k), top_p)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1])[None]
    cum = sorted_p.cumsum(dim=-1)
    drop = (ranks >= top_k[:, None]) | ((cum - sorted_p) > top_p[:, None] * cum[:, -1:])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def _or_one_hot(probs: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Rows left with nothing to draw from (every token banned) take their best token instead."""
    usable = torch.isfinite(probs).all(dim=-1, keepdim=True) & (probs.sum(dim=-1, keepdim=True) > 0)
    return torch.where(usable, probs, torch.nn.functional.one_hot(best, probs.shape[1]).to(probs.dtype))


def _result(token: int, raw: torch.Tensor | None, req: Request) -> SampleResult:
    n = req.params.logprobs
    if raw is None or n is None:
        return SampleResult(token, None)
    chosen = float(raw[token])
    top: dict[int, Logprob] = {token: Logprob(chosen, int((raw > raw[token]).sum()) + 1)}
    if n > 0:
        values, ids = raw.topk(min(n, raw.shape[0]))
        for rank, (tid, val) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
            top.setdefault(tid, Logprob(val, rank))
    return SampleResult(token, top)
