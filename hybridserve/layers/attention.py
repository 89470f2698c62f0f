"""Attention of query blocks over gathered cache rows with a per-head sink (one softmax over every key
+ sink), K = V.

A block of Q queries shares its key rows (the raw window around the block, a request's compressed
rows), each query seeing its own subset; CSA's top-k rows differ per query and come as a second key
set. Q = 1 is plain per-query attention.
"""

from __future__ import annotations

import torch

# Bounds the [queries, heads, keys] score tensor of one chunk (elements).
_MAX_SCORE_ELEMENTS = 1 << 24

Selected = tuple[torch.Tensor, torch.Tensor]  # per-query keys [B * Q, k, d] and visible [B * Q, k]


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
    selected: Selected | None = None,
) -> torch.Tensor:
    """``q`` [B * Q, H, d] padded queries, ``keys`` [B, L, d] each block's keys, ``visible`` [B, Q, L]
    bool, ``sinks`` [H], ``selected`` optional per-query keys -> [B * Q, H, d].

    Scores in the model dtype, softmax in float32 with the sink as one more logit that is dropped
    afterwards, weights cast back to the model dtype (the reference's eager path). With ``selected``
    the two weighted sums are added in float32 and rounded once, as one matmul over both would; with one
    query a block (decode steps) the selected keys are just more block keys.
    """
    if selected is not None and visible.shape[1] == 1:
        keys, visible = torch.cat([keys, selected[0]], 1), torch.cat([visible, selected[1][:, None]], 2)
        selected = None
    B, L = keys.shape[0], keys.shape[1]
    Q, H = visible.shape[1], q.shape[1]
    width = L + (0 if selected is None else selected[0].shape[1])
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, Q * H * width))
    if step >= B:
        return _attend(q, keys, visible, sinks, scaling, selected)
    outs = []
    for b in range(0, B, step):
        rows = slice(b * Q, (b + step) * Q)
        sel = None if selected is None else (selected[0][rows], selected[1][rows])
        outs.append(_attend(q[rows], keys[b : b + step], visible[b : b + step], sinks, scaling, sel))
    return torch.cat(outs)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scaling: float,
    selected: Selected | None,
) -> torch.Tensor:
    B, Q, L = visible.shape
    T, H, d = q.shape
    scores = torch.matmul(q.view(B, Q * H, d), keys.transpose(1, 2)) * scaling  # [B, Q * H, L]
    parts, masks = [scores.view(B, Q, H, L).float()], [visible]
    if selected is not None:
        sel_keys, sel_visible = selected
        k = sel_keys.shape[1]
        sel = torch.matmul(q, sel_keys.transpose(1, 2)) * scaling  # [T, H, k]
        parts.append(sel.float().view(B, Q, H, k))
        masks.append(sel_visible.view(B, Q, k))
    parts.append(sinks.float().view(1, 1, H, 1).expand(B, Q, H, 1))
    masks.append(visible.new_ones(B, Q, 1))
    # Masking by adding 0 / -inf (a [B, Q, 1, L] bias, broadcast over heads) is exact and ~10x faster on
    # CPU than a broadcast masked_fill; softmax subtracts the row max itself, bit for bit as the
    # reference's explicit subtraction does.
    bias = torch.zeros(B, Q, 1, L + 1 + (0 if selected is None else k), device=q.device)
    logits = torch.cat(parts, dim=-1) + bias.masked_fill_(~torch.cat(masks, -1)[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    shared = probs[..., :L].reshape(B, Q * H, L)
    if selected is None:
        return torch.matmul(shared, keys).view(T, H, d)
    sel_keys = selected[0]
    picked = probs[..., L:].reshape(T, H, sel_keys.shape[1])
    if keys.dtype == torch.float32:
        return torch.matmul(shared, keys).view(T, H, d) + torch.matmul(picked, sel_keys)
    out = torch.matmul(shared.float(), keys.float()).view(T, H, d)
    return (out + torch.matmul(picked.float(), sel_keys.float())).to(keys.dtype)
