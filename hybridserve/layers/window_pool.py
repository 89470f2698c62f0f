"""A compressor's pooling of the windows a step completes: softmax(gate + ape)-weighted sum of a window's
per-token rows, RMS-normed, roped.

A compiled decode step has static shapes, so it pools one window per request on every step and writes the
rows of requests that completed none into the null block. For an HCA compressor (a window of 128 tokens)
that is 127 wasted poolings in 128 (a batch-64 step of the 72M benchmark checkpoint: 93.1 -> 91.4 ms median
with this op). :func:`pool_windows` is an opaque op for compiled CPU steps that pools only when some request
completes a window, and returns zero rows (what pooling the null block's zero rows gives) otherwise.
Not ``torch.cond``: inductor's FX graph cache refuses graphs holding one, so every start would recompile.
"""

from __future__ import annotations

import torch

from hybridserve.layers.norm import rms_norm
from hybridserve.layers.rope import apply_rope


def pooled_rows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    valid: torch.Tensor,
    ape: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``kv``/``gate`` [Nw, span, width] gathered rows, ``valid`` [Nw, span] -> pooled rows [Nw, dim]
    (before rope). With ``width == 2 * dim`` (CSA's overlap; ``span == 2 * rate``), row w mixes the first
    half of window w-1's tokens with the second half of window w's."""
    m, d = ape.shape[0], weight.shape[0]
    if kv.shape[-1] == 2 * d:
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d] + ape[:, :d], gate[:, m:, d:] + ape[:, d:]], dim=1)
    else:
        gate = gate + ape
    kv = kv.masked_fill(~valid[..., None], 0)
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return rms_norm((kv * weights).sum(dim=1), weight, eps)


@torch.library.custom_op("hybridserve::pool_windows", mutates_args=())
def pool_windows(
    kv_rows: torch.Tensor,
    gate_rows: torch.Tensor,
    src: torch.Tensor,
    valid: torch.Tensor,
    completes: torch.Tensor,
    ape: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """:func:`pooled_rows` of the rows ``src`` [Nw, span] of ``kv_rows``/``gate_rows`` [N, width], roped
    -> [Nw, dim]; zero rows when ``completes`` (0-dim bool) is false. Reads ``completes`` on the host."""
    n, span = src.shape
    if not bool(completes):
        return kv_rows.new_zeros(n, weight.shape[0])
    index = src.reshape(-1)
    kv = kv_rows.index_select(0, index).view(n, span, -1)
    gate = gate_rows.index_select(0, index).view(n, span, -1)
    return apply_rope(pooled_rows(kv, gate, valid, ape, weight, eps), cos, sin)


@pool_windows.register_fake
def _pool_windows_shape(
    kv_rows: torch.Tensor,
    gate_rows: torch.Tensor,
    src: torch.Tensor,
    valid: torch.Tensor,
    completes: torch.Tensor,
    ape: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    return kv_rows.new_empty(src.shape[0], weight.shape[0])
