"""The reference: transformers' DeepseekV4ForCausalLM, always one sequence at a time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import load_reference


@cache
def reference_model(folder: Path, dtype: str = "float32") -> Any:
    return load_reference(folder, dtype)


@contextmanager
def stable_indexer_topk() -> Iterator[None]:
    """Make the reference's indexer break exact top-k ties by row number, as hybridserve does.

    transformers calls ``Tensor.topk`` only in the Lightning Indexer (its router uses
    ``torch.topk``), so this changes nothing but the order of exactly tied rows.
    """
    original = torch.Tensor.topk

    def stable(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = stable  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class GreedyTrace:
    """One reference greedy run: prefill in one shot, then one token at a time through its own cache.

    Everything is read off that one incremental path, so a proof about a divergence speaks about the
    very forward passes that produced the reference's tokens.
    """

    tokens: tuple[int, ...]
    top2: tuple[tuple[int, int], ...]  # per step: the best and second-best token ids
    gaps: tuple[float, ...]  # per step: best minus second-best logit
    ties: tuple[int, ...]  # absolute query positions whose indexer top-k boundary is an exact tie

    def first_tie_at_or_before(self, position: int) -> int | None:
        return next((p for p in sorted(self.ties) if p <= position), None)


@cache
def greedy_trace(
    folder: Path, prompt: tuple[int, ...], max_new: int, dtype: str = "float32", stable: bool = False
) -> GreedyTrace:
    from transformers import DynamicCache

    model = reference_model(folder, dtype)
    cache_ = DynamicCache(config=model.config)
    tokens: list[int] = []
    top2: list[tuple[int, int]] = []
    gaps: list[float] = []
    step = list(prompt)
    with torch.no_grad(), stable_indexer_topk() if stable else nullcontext(), indexer_ties(model) as ties:
        for _ in range(max_new):
            logits = model(torch.tensor([step]), past_key_values=cache_, use_cache=True).logits[0, -1]
            values, ids = logits.float().topk(2)
            top2.append((int(ids[0]), int(ids[1])))
            gaps.append(float(values[0] - values[1]))
            step = [int(logits.argmax())]
            tokens += step
    return GreedyTrace(tuple(tokens), tuple(top2), tuple(gaps), tuple(sorted(set(ties))))


@contextmanager
def indexer_ties(model: Any) -> Iterator[list[int]]:
    """Collect the absolute positions of queries whose indexer top-k boundary falls in an exact tie."""
    cfg = model.config
    m, k = cfg.compress_rates["compressed_sparse_attention"], cfg.index_topk
    ties: list[int] = []
    positions: list[torch.Tensor] = []
    hooks = []

    def remember(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        positions.append(kwargs["position_ids"] if "position_ids" in kwargs else args[2])

    def inspect(module: Any, args: Any, scores: torch.Tensor) -> None:
        for s, pos in enumerate(positions.pop()[0].tolist()):
            valid = scores[0, s, : (pos + 1) // m]
            if valid.numel() > k:
                top = valid.sort(descending=True).values
                if top[k - 1] == top[k]:
                    ties.append(pos)

    for layer in model.model.layers:
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_pre_hook(remember, with_kwargs=True))
            hooks.append(indexer.scorer.register_forward_hook(inspect))
    try:
        yield ties
    finally:
        for h in hooks:
            h.remove()


def reference_greedy(
    folder: Path, prompt: list[int], max_new: int, dtype: str = "float32", stable_ties: bool = False
) -> list[int]:
    """Greedy continuation of one prompt: prefill in one shot, then one token at a time, no stopping
    (``generate``'s ``min_new_tokens`` would mask EOS, which ``ignore_eos`` does not)."""
    return list(greedy_trace(folder, tuple(prompt), max_new, dtype, stable_ties).tokens)


def chunked_logits(model: Any, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, computed in the given chunks through the reference's own cache."""
    from transformers import DynamicCache

    cache_ = DynamicCache(config=model.config)
    out, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            logits = model(
                torch.tensor([token_ids[pos : pos + c]]), past_key_values=cache_, use_cache=True
            ).logits
            out.append(logits[0])
            pos += c
    return torch.cat(out)
