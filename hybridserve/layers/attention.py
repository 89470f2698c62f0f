"""Attention over gathered cache rows with a per-head sink (one softmax over every key + sink)."""

from __future__ import annotations

import torch

# Bounds the [tokens, heads, keys] score tensor of one chunk (elements).
_MAX_SCORE_ELEMENTS = 1 << 24


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scaling: float
) -> torch.Tensor:
    """K = V attention: ``q`` [T, H, d], ``keys`` [T, L, d], ``visible`` [T, L] bool, ``sinks`` [H].

    Scores in the model dtype, softmax in float32 with the sink as one more logit that is dropped
    afterwards, weights cast back to the model dtype (the reference's eager path).
    """
    T, H, _ = q.shape
    L = keys.shape[1]
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, H * L))
    if step >= T:
        return _attend(q, keys, visible, sinks, scaling)
    return torch.cat(
        [
            _attend(q[i : i + step], keys[i : i + step], visible[i : i + step], sinks, scaling)
            for i in range(0, T, step)
        ]
    )


def _attend(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scaling: float
) -> torch.Tensor:
    scores = torch.matmul(q, keys.transpose(1, 2)) * scaling  # [T, H, L]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores.float(), sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys)
