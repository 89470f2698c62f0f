"""Prompt logprobs: each prompt token's logprob (and the top n) given the tokens before it, from the rows
a prefill step computes anyway. Requests that ask for them skip the prefix cache (see the scheduler)."""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.request import Logprob, Request
from hybridserve.models.interface import PagedModel

CHUNK_ROWS = 256  # rows turned into full-vocabulary logits at once


def gather_prompt_logprobs(
    model: PagedModel[Any], scheduled: list[ScheduledRequest], streams: torch.Tensor
) -> None:
    """Append to ``request.prompt_logprobs`` the entries this step's rows give (position p predicts p + 1)."""
    offset = 0
    for s in scheduled:
        req, first = s.request, offset
        offset += s.num_tokens
        n = req.params.prompt_logprobs
        if n is None or not gathers_prompt_logprobs(s):
            continue
        end = min(s.end, len(req.prompt_token_ids) - 1)
        del req.prompt_logprobs[s.start :]  # a recompute after preemption overwrites
        for lo in range(s.start, end, CHUNK_ROWS):
            hi = min(end, lo + CHUNK_ROWS)
            rows = streams[first + lo - s.start : first + hi - s.start]
            targets = torch.tensor(req.prompt_token_ids[lo + 1 : hi + 1], device=rows.device)
            req.prompt_logprobs += _entries(model.compute_logits(rows).float(), targets, n)


def gathers_prompt_logprobs(s: ScheduledRequest) -> bool:
    """Whether this step's rows give prompt logprobs the request asked for."""
    req = s.request
    wanted = req.params.prompt_logprobs is not None and not req.output_token_ids
    return wanted and s.start < min(s.end, len(req.prompt_token_ids) - 1)


def _entries(logits: torch.Tensor, targets: torch.Tensor, n: int) -> list[dict[int, Logprob]]:
    logprobs = torch.log_softmax(logits, dim=-1).nan_to_num(neginf=-1e30)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    values, ids = logprobs.topk(min(n, logprobs.shape[1]), dim=-1)
    out = []
    for tok, lp, rank, top_ids, top_vals in zip(
        targets.tolist(),
        chosen.flatten().tolist(),
        ranks.tolist(),
        ids.tolist(),
        values.tolist(),
        strict=True,
    ):
        entry = {tok: Logprob(lp, rank)}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals, strict=True), start=1):
            entry.setdefault(tid, Logprob(val, r))
        out.append(entry)
    return out


def prompt_logprobs_of(req: Request) -> list[dict[int, Logprob] | None] | None:
    """What the request's first output carries: None for the first prompt token, then one per token."""
    if req.params.prompt_logprobs is None:
        return None
    return [None, *req.prompt_logprobs]
