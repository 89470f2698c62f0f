"""The MTP layer applied as the engine drafts with it: depth 1 on the trunk's streams, depth k > 1 on its
own output one position further, every depth reading the one window of MTP rows.

At draft time (engine/spec_decode/decoder.py) the chain starts at the last verified position b: depth 1
runs at b on the trunk's streams h[b] and token b+1; depth k runs at position b+k-1 on depth k-1's output
and the token it drafted, and its window holds depth-1 rows at positions <= b (built from the trunk's streams)
and the chain's own rows b+1 .. b+k-1. Training every base b at once, depth k is a segment of queries
appended to the sequence, with a mask that shows each query exactly those rows:

    keys:    depth-1 rows 0 .. L-1 | depth-2 rows (base 0 .. L-2) | ...
    depth 1, base t:  depth-1 rows t' <= t in the window
    depth k, base t:  depth-1 rows t' <= t in the window, and depth-j row of base t for 2 <= j <= k

Teacher forcing feeds the sequence's own token b+k at depth k (a wrong draft is rejected anyway).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.train.mtp import MTPModule


def chain_mask(
    length: int, depth: int, window: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (additive mask [1, 1, N, N], positions [N]) for ``depth`` segments over ``length`` MTP bases.

    Segment k (1-based) holds bases 0 .. length-k at positions base + k - 1."""
    bases = [torch.arange(length - k + 1, device=device) for k in range(1, depth + 1)]
    seg = torch.cat([torch.full_like(b, k) for k, b in enumerate(bases, start=1)])
    base = torch.cat(bases)
    pos = base + seg - 1
    q_seg, k_seg = seg[:, None], seg[None, :]
    q_base, k_base = base[:, None], base[None, :]
    in_window = (pos[:, None] - pos[None, :] < window) & (pos[:, None] >= pos[None, :])
    trunk_rows = (k_seg == 1) & (k_base <= q_base)
    own_chain = (k_seg > 1) & (k_base == q_base) & (k_seg <= q_seg)
    allowed = in_window & (trunk_rows | own_chain)
    bias = torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))
    return bias[None, None], pos


def mtp_input(
    mtp: MTPModule, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding
) -> torch.Tensor:
    """h_proj(hnorm(streams)) + e_proj(enorm(embed(next token))), [B, S, hc, D]."""
    e = mtp.enorm(embed(next_ids))
    return mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(e).unsqueeze(-2)


def run_block(mtp: MTPModule, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    position_ids = positions[None].expand(x.shape[0], -1)
    rope = {
        kind: mtp.rotary_emb(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")
    }
    out: torch.Tensor = mtp.block(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask)
    return out


def chain_logits(
    mtp: MTPModule,
    streams: torch.Tensor,
    ids: torch.Tensor,
    depth: int,
    embed: nn.Embedding,
    head: nn.Linear,
) -> list[torch.Tensor]:
    """``streams`` [B, S, hc, D]: the trunk's at positions 0..S-1 of ``ids`` [B, S]. -> per depth k the
    logits [B, S-k, V] of bases t = 0 .. S-k-1, which predict token t + k + 1."""
    length = ids.shape[1] - 1  # bases with a next token
    window = mtp.config.sliding_window
    inputs = [mtp_input(mtp, streams[:, :length], ids[:, 1:], embed)]
    out: list[torch.Tensor] = []
    for k in range(1, depth + 1):
        mask, pos = chain_mask(length, k, window, ids.device)
        y = run_block(mtp, torch.cat(inputs, dim=1), pos, mask)[:, -(length - k + 1) :]
        usable = y[:, : length - k]  # the last base has no token to feed the next depth, nor a target here
        out.append(head(mtp.norm(mtp.hc_head(usable))))
        if k < depth:
            inputs.append(mtp_input(mtp, usable, ids[:, k + 1 :], embed))
    return out
