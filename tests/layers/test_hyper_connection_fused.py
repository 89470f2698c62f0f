"""The fused mHC (eager and torch.compile'd) against a transcription of the original per-op loop.

Tolerance: the eager path and, for ``hc_mult <= 4``, the compiled path must be bit-identical to the
transcription (the bf16 parity tests compare logits with tolerance 0). For wider ``hc_mult`` the
compiled path sums in a different order than ATen: there the largest difference must stay below
1e-6 times the largest magnitude of the tensor (float32 rounding; measured: 2.4e-7 on comb <= 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from hybridserve.layers import hyper_connection as mhc
from hybridserve.layers.hyper_connection import HyperConnection, HyperHead, hyper_residual
from hybridserve.layers.norm import unweighted_rms_norm

HIDDEN = 48
ITERS = 20
EPS = 1e-6


# ---- reference: the pre-fusion implementation, op for op ------------------------------------------
def reference_hc(
    m: HyperConnection, streams: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hc = m.hc
    flat = unweighted_rms_norm(streams.flatten(1).float(), m.norm_eps)
    mixes = F.linear(flat, m.fn)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = m.base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = m.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + m.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + m.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + m.hc_eps)
    for _ in range(m.iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + m.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + m.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def reference_residual(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def reference_head(m: HyperHead, streams: torch.Tensor) -> torch.Tensor:
    flat = unweighted_rms_norm(streams.flatten(1).float(), m.norm_eps)
    mixes = F.linear(flat, m.hc_fn)
    pre = torch.sigmoid(mixes * m.hc_scale + m.hc_base) + m.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ---- helpers ---------------------------------------------------------------------------------------
def _random_hc(hc: int, seed: int = 0) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    m = HyperConnection(hc, HIDDEN, ITERS, EPS, 1e-6)
    with torch.no_grad():
        m.fn.copy_(torch.randn(m.fn.shape, generator=g) / (hc * HIDDEN) ** 0.5 * 2)
        m.base.copy_(torch.randn(m.base.shape, generator=g) * 0.5)
        m.scale.copy_(torch.rand(3, generator=g) * 1.5 + 0.5)
    return m


def _streams(t: int, hc: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, hc, HIDDEN, generator=g) * 3).to(dtype)


def _assert_equal(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def _tail_inputs(t: int, hc: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t * 31 + hc)
    pre = torch.rand(t, hc, generator=g)
    post = torch.rand(t, hc, generator=g)
    comb = torch.softmax(torch.randn(t, hc, hc, generator=g) * 3, dim=-1)
    return pre, post, comb, _streams(t, hc, dtype)


@pytest.fixture(autouse=True)
def _restore_compile_flag() -> Iterator[None]:
    before = mhc.compile_enabled()
    yield
    mhc.set_compile(before)


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.inference_mode():
        return fn(*args)


# ---- eager path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("hc", [1, 2, 3, 4, 8])
def test_eager_forward_is_bit_identical_to_reference(hc: int, t: int, dtype: torch.dtype) -> None:
    mhc.set_compile(False)
    m, streams = _random_hc(hc), _streams(t, hc, dtype)
    _assert_equal(_run(m, streams), _run(reference_hc, m, streams))


def test_eager_forward_without_inference_mode() -> None:
    mhc.set_compile(False)
    m, streams = _random_hc(4), _streams(5, 4, torch.float32)
    _assert_equal(m(streams), reference_hc(m, streams))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("hc", [1, 4])
def test_residual_and_head_are_bit_identical_to_reference(hc: int, t: int, dtype: torch.dtype) -> None:
    m, streams = _random_hc(hc), _streams(t, hc, dtype)
    post, comb, _ = _run(reference_hc, m, streams)
    out = _streams(t, 1, dtype, seed=5)[:, 0]
    _assert_equal(
        (_run(hyper_residual, out, streams, post, comb),), (reference_residual(out, streams, post, comb),)
    )
    head = HyperHead(hc, HIDDEN, EPS, 1e-6)
    with torch.no_grad():
        head.hc_fn.copy_(m.fn[:hc])
        head.hc_base.copy_(m.base[:hc])
        head.hc_scale.fill_(1.3)
    _assert_equal((_run(head, streams),), (_run(reference_head, head, streams),))


@pytest.mark.parametrize("hc", [2, 4])
def test_eager_tail_is_batch_invariant(hc: int) -> None:
    """Sinkhorn and collapse give each token the same bits whatever else is in the batch.

    (The sigmoids before them are not: ATen's CPU sigmoid rounds its vectorised body and its scalar
    tail differently. The reference shares that, and both paths keep its exact calls.)
    """
    inputs = _tail_inputs(37, hc, torch.bfloat16)
    whole = _run(mhc.mhc_tail_eager, *inputs, ITERS, EPS)
    for i in (0, 5, 36):
        alone = _run(mhc.mhc_tail_eager, *(x[i : i + 1].clone() for x in inputs), ITERS, EPS)
        _assert_equal(alone, tuple(w[i : i + 1] for w in whole))


def test_eager_tail_leaves_inputs_alone() -> None:
    inputs = _tail_inputs(4, 4, torch.float32)
    copies = tuple(x.clone() for x in inputs)
    _run(mhc.mhc_tail_eager, *inputs, ITERS, EPS)
    _assert_equal(inputs, copies)


def test_unrolled_tail_is_bit_identical_eagerly() -> None:
    """The function handed to torch.compile, run eagerly, equals the eager tail (hc <= 4)."""
    for hc in (1, 2, 3, 4):
        inputs = _tail_inputs(9, hc, torch.bfloat16)
        _assert_equal(
            _run(mhc.mhc_tail_unrolled, *inputs, ITERS, EPS), _run(mhc.mhc_tail_eager, *inputs, ITERS, EPS)
        )


# ---- compiled path ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("hc", "dtype"), [(4, torch.float32), (4, torch.bfloat16), (2, torch.float32)])
def test_compiled_forward_is_bit_identical_for_every_token_count(hc: int, dtype: torch.dtype) -> None:
    mhc.set_compile(True)
    m = _random_hc(hc)
    _run(m, _streams(3, hc, dtype))  # compiles (lazily) on the first call
    graphs = counters["stats"]["unique_graphs"]
    for t in (1, 2, 16, 41):
        streams = _streams(t, hc, dtype, seed=t)
        _assert_equal(_run(m, streams), _run(reference_hc, m, streams))
    assert mhc.compile_enabled(), "compilation failed and fell back to eager"
    assert counters["stats"]["unique_graphs"] == graphs, "a new token count recompiled"


def test_compiled_tail_is_batch_invariant() -> None:
    mhc.set_compile(True)
    inputs = _tail_inputs(37, 4, torch.float32)
    whole = _run(mhc.mhc_tail, *inputs, ITERS, EPS)
    for i in (0, 36):
        alone = _run(mhc.mhc_tail, *(x[i : i + 1].clone() for x in inputs), ITERS, EPS)
        _assert_equal(alone, tuple(w[i : i + 1] for w in whole))
    assert mhc.compile_enabled()


def test_compiled_forward_wide_hc_within_fp32_rounding() -> None:
    mhc.set_compile(True)
    m, streams = _random_hc(8), _streams(16, 8, torch.float32)
    got, want = _run(m, streams), _run(reference_hc, m, streams)
    assert mhc.compile_enabled()
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_empty_batch_stays_eager() -> None:
    mhc.set_compile(True)
    m = _random_hc(4)
    post, comb, collapsed = _run(m, _streams(0, 4, torch.float32))
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and collapsed.shape == (0, HIDDEN)


def test_single_stream_stays_eager() -> None:
    mhc.set_compile(True)
    m, streams = _random_hc(1), _streams(3, 1, torch.float32)
    graphs = counters["stats"]["unique_graphs"]
    _assert_equal(_run(m, streams), _run(reference_hc, m, streams))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_stream_traced_into_a_graph_is_bit_identical(dtype: torch.dtype) -> None:
    """hc_mult = 1 inside a larger compiled graph (the compiled decode step): the Sinkhorn of the 1x1 mix
    is a precomputed number, equal to the eager chain's; traced as a chain, inductor's inlining doubled
    the expression with every division and 20 iterations never finished compiling. The rest of the
    traced forward (norm, projection, sigmoids) rounds like any compiled fp32 code."""
    m = _random_hc(1)
    streams = _streams(5, 1, dtype)
    compiled = torch.compile(m.forward, backend="inductor", fullgraph=True, dynamic=False)
    with torch.no_grad():
        post, comb, collapsed = compiled(streams)
    want_post, want_comb, want_collapsed = _run(reference_hc, m, streams)
    assert torch.equal(comb, want_comb) and comb.dtype == torch.float32
    torch.testing.assert_close(post, want_post, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        collapsed.float(), want_collapsed.float(), atol=0.02 if dtype == torch.bfloat16 else 1e-5, rtol=0
    )


def test_compile_failure_falls_back_to_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(mhc, "_compiled_tail", lambda: broken)
    mhc.set_compile(True)
    m, streams = _random_hc(4), _streams(6, 4, torch.float32)
    with caplog.at_level(logging.WARNING, logger=mhc.__name__):
        got = _run(m, streams)
    _assert_equal(got, _run(reference_hc, m, streams))
    assert not mhc.compile_enabled()
    assert "eager path" in caplog.text


def test_warm_up_compiles_before_the_first_step() -> None:
    """``warm_compiled_tail`` compiles the model's tail while it is still switched off (other threads'
    steps keep the eager tail until it is switched on); once on, the first real step, at another token
    count, compiles nothing more. A model without a tail of 2 or more streams has nothing to compile."""
    assert not mhc.warm_compiled_tail([_random_hc(1)], torch.device("cpu"), torch.float32)
    model = torch.nn.Sequential(_random_hc(4))
    mhc.set_compile(False)
    assert mhc.warm_compiled_tail(model.modules(), torch.device("cpu"), torch.float32)
    assert not mhc.compile_enabled()
    mhc.set_compile(True)
    graphs = counters["stats"]["unique_graphs"]
    streams = _run(_streams, 29, 4, torch.float32)  # made like a step's: an inference tensor
    _assert_equal(_run(model[0], streams), _run(reference_hc, model[0], streams))
    assert counters["stats"]["unique_graphs"] == graphs and mhc.compile_enabled()


def test_a_tail_traced_into_a_compiled_graph_is_the_eager_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a larger compiled region (a compiled step) the tail is traced as the eager ops, out of place
    (``traced_tail``, a nested compile region), not as the separately compiled tail."""
    calls: list[str] = []
    monkeypatch.setattr(mhc, "_compiled_tail", lambda: calls.append("nested") or mhc.mhc_tail_unrolled)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    mhc.set_compile(True)
    m, streams = _random_hc(4), _streams(5, 4, torch.float32)
    _assert_equal(_run(m, streams), _run(reference_hc, m, streams))
    assert calls == []
