"""Sink attention of query blocks, one-shot and chunked, with and without per-query selected keys,
against the formula written per query: one softmax over the visible keys' scores plus the head's sink
logit, K = V."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.layers import attention
from hybridserve.layers.attention import sink_attention


def _direct(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    selected: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    T, H, d = q.shape
    Q = visible.shape[1]
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        b, i = divmod(t, Q)
        rows = keys[b][visible[b, i]].double()
        if selected is not None:
            rows = torch.cat([rows, selected[0][t][selected[1][t]].double()])
        for h in range(H):
            logits = [float(q[t, h].double() @ k) * scale for k in rows] + [float(sinks[h])]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for w, k in zip(weights[:-1], rows, strict=True):
                out[t, h] += w / total * k
    return out


def _inputs(B: int, Q: int, H: int, L: int, d: int, k: int) -> tuple:
    g = torch.Generator().manual_seed(B * 100 + Q * 10 + L)
    q, keys = torch.randn(B * Q, H, d, generator=g), torch.randn(B, L, d, generator=g)
    visible = torch.rand(B, Q, L, generator=g) < 0.6
    visible[0, 0] = False  # a query that sees nothing but the sink: output 0
    sel = (torch.randn(B * Q, k, d, generator=g), torch.rand(B * Q, k, generator=g) < 0.5)
    sel[1][0] = False
    return q, keys, visible, torch.randn(H, generator=g), sel


@pytest.mark.parametrize("with_selected", [False, True])
@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("max_elements", [None, 1], ids=["one_shot", "block_by_block"])
def test_sink_attention_equals_the_formula(
    monkeypatch: pytest.MonkeyPatch, max_elements: int | None, Q: int, with_selected: bool
) -> None:
    B, H, L, d = 5, 4, 9, 8
    if max_elements is not None:
        monkeypatch.setattr(attention, "_MAX_SCORE_ELEMENTS", max_elements)
    q, keys, visible, sinks, sel = _inputs(B, Q, H, L, d, k=4)
    selected = sel if with_selected else None
    got = sink_attention(q, keys, visible, sinks, 0.3, selected)
    expected = _direct(q, keys, visible, sinks, 0.3, selected)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    assert bool((got[0] == 0).all())


def test_selected_keys_are_summed_once_in_bf16() -> None:
    """In bf16 the two weighted sums of a block (its shared keys, each query's selected keys) round once,
    like one matmul over both: the same bits as attending query by query to the concatenated keys."""
    B, Q, H, L, d = 20, 2, 4, 6, 8
    q, keys, visible, sinks, (sel_keys, sel_visible) = _inputs(B, Q, H, L, d, k=3)
    q, keys, sel_keys = q.bfloat16(), keys.bfloat16(), sel_keys.bfloat16()
    got = sink_attention(q, keys, visible, sinks, 0.3, (sel_keys, sel_visible))
    per_query_keys = torch.cat([keys.repeat_interleave(Q, 0), sel_keys], 1)  # [B * Q, L + k, d]
    per_query_visible = torch.cat([visible.flatten(0, 1), sel_visible], 1)[:, None]  # [B * Q, 1, L + k]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, sink_attention(q, per_query_keys, per_query_visible, sinks, 0.3))
