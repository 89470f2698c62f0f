"""Token selection: penalties, greedy / temperature / top-k / top-p / min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.engine.request import Logprob, Request


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
        logits = logits.float()
        raw = (
            torch.log_softmax(logits, dim=-1)
            if any(r.params.logprobs is not None for r in requests)
            else None
        )
        logits = logits.clone()
        for i, req in enumerate(requests):
            _apply_min_tokens(logits[i], req)
            _apply_penalties(logits[i], req)
        tokens = self._choose(logits.cpu(), requests)
        return [
            _result(tok, raw[i] if raw is not None else None, req)
            for i, (tok, req) in enumerate(zip(tokens, requests, strict=True))
        ]

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not random_rows:
            return list(greedy)
        probs = _filtered_probs(logits[random_rows], [requests[i] for i in random_rows])
        tokens = list(greedy)
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


def _apply_min_tokens(row: torch.Tensor, req: Request) -> None:
    if len(req.output_token_ids) < req.params.min_tokens:
        banned = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else list(req.eos_token_ids))
        if banned:
            row[banned] = float("-inf")


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0)
    top_k = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in requests]
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=logits.dtype)
    if min(top_k) < logits.shape[1] or bool((top_p < 1).any()):
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


def _result(token: int, raw: torch.Tensor | None, req: Request) -> SampleResult:
    n = req.params.logprobs
    if raw is None or n is None:
        return SampleResult(token, None)
    chosen = float(raw[token])
    top: dict[int, Logprob] = {token: Logprob(chosen, int((raw > raw[token]).sum()) + 1)}
    if n > 0:
        values, ids = raw.topk(n)
        for rank, (tid, val) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
            top.setdefault(tid, Logprob(val, rank))
    return SampleResult(token, top)
