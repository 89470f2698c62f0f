"""Sink attention, both the one-shot and the chunked branch, against the formula written per query:
one softmax over the visible keys' scores plus the head's sink logit, K = V."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.layers import attention
from hybridserve.layers.attention import sink_attention


def _direct(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float):
    T, H, d = q.shape
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        rows = keys[t][visible[t]].double()
        for h in range(H):
            logits = [float(q[t, h].double() @ k) * scale for k in rows] + [float(sinks[h])]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for w, k in zip(weights[:-1], rows, strict=True):
                out[t, h] += w / total * k
    return out


def _inputs(T: int, H: int, L: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(T * 100 + L)
    q, keys = torch.randn(T, H, d, generator=g), torch.randn(T, L, d, generator=g)
    visible = torch.rand(T, L, generator=g) < 0.6
    visible[0] = False  # a query that sees nothing but the sink: output 0
    return q, keys, visible, torch.randn(H, generator=g)


@pytest.mark.parametrize(
    "max_elements", [None, 3 * 4 * 9, 4 * 9], ids=["one_shot", "chunks_of_3", "chunks_of_1"]
)
def test_sink_attention_equals_the_formula(monkeypatch: pytest.MonkeyPatch, max_elements: int | None) -> None:
    T, H, L, d = 11, 4, 9, 8  # 11 queries: chunks of 3 leave a ragged last chunk
    if max_elements is not None:
        monkeypatch.setattr(attention, "_MAX_SCORE_ELEMENTS", max_elements)
        assert max(1, max_elements // (H * L)) < T  # the chunked branch runs
    q, keys, visible, sinks = _inputs(T, H, L, d)
    got = sink_attention(q, keys, visible, sinks, scaling=0.3)
    torch.testing.assert_close(got.double(), _direct(q, keys, visible, sinks, 0.3), atol=1e-5, rtol=0)
    assert bool((got[0] == 0).all())
