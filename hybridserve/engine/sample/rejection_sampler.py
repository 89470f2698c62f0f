"""Speculative sampling: drafts drawn from the drafter's distribution q, verified against the target's p.

Greedy requests keep the longest prefix of drafts that equals the target's argmax, plus the target's
token after it (the bonus). Random requests use standard rejection sampling: draft i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); the first rejected position draws from the normalised residual
max(0, p_i - q_i), and if every draft is accepted the bonus is drawn from p_{k+1}. The emitted tokens are
then distributed exactly as plain sampling from p would draw them.

Both p and q are the plain sampler's distributions: penalties (counted over the request's outputs plus
the drafts before the position), min_tokens bans, temperature, min-p, top-k and top-p, through the same
functions. A seeded request draws every uniform from its own generator, a fixed number per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.engine.request import Request
from hybridserve.engine.sample.ops import (
    Filters,
    SampleResult,
    best_tokens,
    filtered_weights,
    finite,
    penalises,
    sample_results,
)
from hybridserve.engine.sample.sampler import Sampler
from hybridserve.engine.sample.structured_outputs import unpack_bitmask, xgr  # xgrammar on first use


@dataclass
class Verified:
    """One request's verification: the tokens to commit (accepted drafts, then one more)."""

    results: list[SampleResult]
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.results) - 1


def with_drafts(req: Request, drafts: list[int]) -> Request:
    """``req`` as the sampler sees it after ``drafts`` were appended (for penalties and min_tokens).

    ``req`` itself when the drafts change nothing the sampler reads.
    """
    p = req.params
    if not drafts or not (penalises(p) or p.min_tokens > len(req.output_token_ids)):
        return req
    view = Request(req.request_id, req.prompt_token_ids, p, eos_token_ids=req.eos_token_ids)
    view.output_token_ids = [*req.output_token_ids, *drafts]
    view.generator = None  # a view never draws
    return view


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def _distributions(
        self, logits: torch.Tensor, views: list[Request], grammar: list[tuple[Request, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (raw finite logits, best tokens, normalised probabilities of the rows; None if all greedy).

        ``grammar[row]``: the request whose grammar masks the row and the drafts before the row."""
        raw = finite(logits.float())
        self.sampler.history.release_finished()
        allowed = self._grammar_masked(raw, grammar)
        penalised = self.sampler.penalised(allowed, views)
        best = best_tokens(penalised, allowed)
        if all(v.params.greedy for v in views):
            return raw, best, None
        weights = filtered_weights(penalised, Filters.of(views, raw.shape[1], raw.device))
        total = weights.sum(dim=-1, keepdim=True)
        usable = torch.isfinite(total) & (total > 0)
        onehot = torch.nn.functional.one_hot(best, raw.shape[1]).to(weights.dtype)
        probs = torch.where(usable, weights / total.clamp(min=torch.finfo(weights.dtype).tiny), onehot)
        return raw, best, probs

    def _grammar_masked(self, logits: torch.Tensor, grammar: list[tuple[Request, list[int]]]) -> torch.Tensor:
        """``logits`` with what each constrained row's grammar refuses (after its drafts) at -inf."""
        structured = self.sampler.structured
        rows = [i for i, (r, _) in enumerate(grammar) if r.params.structured_outputs is not None]
        if structured is None or not rows:
            return logits
        structured.release_finished()
        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
        for k, i in enumerate(rows):
            req, drafts = grammar[i]
            scratch = xgr.allocate_token_bitmask(len(drafts) + 1, logits.shape[1])
            structured.fill_bitmask(req, scratch, 0, drafts)
            bitmask[k] = scratch[len(drafts)]
        ok = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
        at = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return logits.index_copy(0, at, logits.index_select(0, at).masked_fill(~ok, float("-inf")))

    def draft(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], torch.Tensor | None]:
        """One draft token per row of the drafter's ``logits`` (after each request's drafts so far); and
        q, the rows' distributions (None when every row is greedy)."""
        views = [with_drafts(r, r.spec_token_ids) for r in requests]
        grammar = [(r, list(r.spec_token_ids)) for r in requests]
        _, best, probs = self._distributions(logits, views, grammar)
        tokens = best.tolist()
        if probs is None:
            return tokens, None
        u = [_uniforms(self.sampler, r, 1)[0] for r in requests]
        drawn = _inverse_transform(probs, u)
        return [b if r.params.greedy else d for d, b, r in zip(drawn, tokens, requests, strict=True)], probs

    def verify(self, logits: torch.Tensor, requests: list[Request], num_drafts: list[int]) -> list[Verified]:
        """``logits``: 1 + num_drafts[r] rows per request, the target at each drafted position and after."""
        rows = [
            (req, req.spec_token_ids[:i])
            for req, n in zip(requests, num_drafts, strict=True)
            for i in range(n + 1)
        ]
        views = [with_drafts(req, drafts) for req, drafts in rows]
        raw, best, probs = self._distributions(logits, views, rows)
        best_ids = best.tolist()
        offsets = [0]
        for n in num_drafts:
            offsets.append(offsets[-1] + n + 1)
        chosen_rows: list[int] = []
        chosen: list[int] = []
        counts: list[int] = []
        for r, (req, n) in enumerate(zip(requests, num_drafts, strict=True)):
            o = offsets[r]
            if req.params.greedy or probs is None:
                tokens = _greedy_accept(best_ids[o : o + n + 1], req.spec_token_ids[:n])
            else:
                tokens = self._sample_accept(probs[o : o + n + 1], req, n)
            chosen_rows += range(o, o + len(tokens))
            chosen += tokens
            counts.append(len(tokens))
        idx = torch.tensor(chosen_rows, dtype=torch.long, device=raw.device)
        row_views = [views[i] for i in chosen_rows]
        results = sample_results(torch.tensor(chosen, device=raw.device), raw.index_select(0, idx), row_views)
        out, at = [], 0
        for n, c in zip(num_drafts, counts, strict=True):
            out.append(Verified(results[at : at + c], n))
            at += c
        return out

    def _sample_accept(self, p: torch.Tensor, req: Request, n: int) -> list[int]:
        """Rejection sampling of ``req``'s first ``n`` drafts against ``p`` [n + 1, V]."""
        u = _uniforms(self.sampler, req, n + 1)
        drafts = req.spec_token_ids[:n]
        ratios: list[float] = []
        if n:
            q = req.spec_probs
            assert q is not None and q.shape[0] >= n, "random drafts need their distribution"
            at = torch.tensor(drafts, dtype=torch.long, device=p.device)[:, None]
            ratios = (p[:n].gather(1, at) / q[:n].to(p.device).gather(1, at)).flatten().tolist()
        accepted = 0
        while accepted < n and u[accepted] < ratios[accepted]:
            accepted += 1
        final = p[accepted]
        if accepted < n:
            residual = (final - q[accepted].to(p.device)).clamp(min=0)  # type: ignore[index]
            if float(residual.sum()) > 0:
                final = residual
        return [*drafts[:accepted], _inverse_transform(final[None], [u[n]])[0]]


def _greedy_accept(target: list[int], drafts: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's token there, then the target's token."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return target[: n + 1]


def _uniforms(sampler: Sampler, req: Request, n: int) -> list[float]:
    """``n`` U[0, 1) draws: from the request's own generator when it has a seed, else the sampler's."""
    gen = req.generator if req.generator is not None else sampler.generator
    return torch.rand(n, generator=gen, dtype=torch.float64, device=gen.device).tolist()


def _inverse_transform(weights: torch.Tensor, u: list[float]) -> list[int]:
    """One token per row of (unnormalised, nonnegative) ``weights``, at quantile ``u[row]``."""
    cum = weights.to(torch.float64).cumsum(dim=-1)
    total = cum[:, -1:]
    x = torch.tensor(u, dtype=torch.float64, device=weights.device)[:, None] * total
    x = torch.minimum(x, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cum, x, right=True).clamp_(max=weights.shape[1] - 1).flatten().tolist()
