"""Quantized linear and experts: bit-equal to the dense modules holding the dequantised weights, on every
expert path; dequantisation only of the experts a call uses; scale grids that do not tile are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.layers import fp8_matmul
from hybridserve.layers.moe import Experts
from hybridserve.layers.quantized_experts import QuantizedExperts
from hybridserve.layers.quantized_linear import QuantLinear
from hybridserve.layers.quantized_weight import (
    E8M0,
    FP4,
    FP8,
    dequantize,
    quantize_fp4,
    quantize_fp8,
    scale_values,
)

HIDDEN, INTER, N_EXPERTS, LIMIT = 64, 32, 6, 2.0
PATHS = ["_grouped", "_gathered", "_dense"]


def _quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_fp4(w) if fmt == FP4 else quantize_fp8(w, block=16)
    return (q.view(torch.uint8) if fmt == FP4 else q), s


def quantized_pair(fmt: str, dtype: torch.dtype) -> tuple[QuantizedExperts, Experts]:
    """Quantized experts from random weights, and dense experts holding exactly their dequantisation."""
    g = torch.Generator().manual_seed(len(fmt))
    w13 = torch.randn(N_EXPERTS, 2, INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(N_EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    q13 = [[_quantize(w13[e, h], fmt) for h in range(2)] for e in range(N_EXPERTS)]
    q2 = [_quantize(w2[e], fmt) for e in range(N_EXPERTS)]
    s13, s2 = q13[0][0][1], q2[0][1]
    weight_dtype = q2[0][0].dtype
    scales = ((tuple(s13.shape), s13.dtype), (tuple(s2.shape), s2.dtype))
    quant = QuantizedExperts(N_EXPERTS, HIDDEN, INTER, LIMIT, fmt, weight_dtype, scales, dtype)
    dense = Experts(N_EXPERTS, HIDDEN, INTER, LIMIT).to(dtype)
    with torch.no_grad():
        quant.gate_up.copy_(torch.stack([torch.cat([q for q, _ in halves]) for halves in q13]))
        quant.gate_up_scale.copy_(torch.stack([torch.cat([s for _, s in halves]) for halves in q13]))
        quant.down.copy_(torch.stack([q for q, _ in q2]))
        quant.down_scale.copy_(torch.stack([s for _, s in q2]))
        for e in range(N_EXPERTS):
            dense.gate_up[e].copy_(torch.cat([dequantize(q, s) for q, s in q13[e]]).to(dtype))
            dense.down[e].copy_(dequantize(*q2[e]).to(dtype))
    return quant, dense


@pytest.mark.parametrize("fmt", [FP8, FP4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens", [1, 2, 5, 40])
def test_quantized_experts_equal_dense_experts_bit_for_bit(
    fmt: str, dtype: torch.dtype, n_tokens: int
) -> None:
    quant, dense = quantized_pair(fmt, dtype)
    g = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, HIDDEN, generator=g).to(dtype)
    idx = torch.randint(0, N_EXPERTS, (n_tokens, 2), generator=g)  # a row may repeat an expert
    w = torch.rand(n_tokens, 2, generator=g).to(dtype)
    with torch.no_grad():
        experts, _slot = idx.sort(dim=1, stable=True)
        for path in PATHS:
            got = getattr(quant, path)(x, experts)
            assert torch.equal(got, getattr(dense, path)(x, experts)), path
        assert torch.equal(quant(x, w, idx), dense(x, w, idx))


def test_a_call_dequantises_only_the_picked_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few rows: only the experts of the (token, slot) pairs are dequantised; many rows: each expert once."""
    quant, _ = quantized_pair(FP8, torch.float32)
    seen: list[int] = []
    import hybridserve.layers.quantized_experts as qe

    def counting(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        seen.append(weight.shape[0])
        return dequantize(weight, scale)

    monkeypatch.setattr(qe, "dequantize", counting)
    x = torch.randn(2, HIDDEN)
    with torch.no_grad():
        quant(x, torch.ones(2, 2), torch.tensor([[1, 3], [3, 4]]))
        assert seen == [4, 4]  # gate_up and down of 4 (token, slot) experts, out of 6
        seen.clear()
        quant(torch.randn(9, HIDDEN), torch.ones(9, 2), torch.randint(0, N_EXPERTS, (9, 2)))
        assert seen == [N_EXPERTS, N_EXPERTS]


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_quant_linear_equals_a_dense_linear_of_its_dequantised_weight(fmt: str) -> None:
    w = torch.randn(48, 64)
    q, s = _quantize(w, fmt)
    layer = QuantLinear(64, 48, fmt, q.dtype, tuple(s.shape), s.dtype)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.scale.copy_(s)
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), F.linear(x, dequantize(q, s).float()))
    assert layer.weight.nbytes == (48 * 64 if fmt == FP8 else 48 * 32)


def test_scale_grids_that_do_not_tile_the_weight_are_refused() -> None:
    with pytest.raises(ValueError, match=r"does not tile a weight of shape \(300, 260\)"):
        dequantize(torch.zeros(300, 260, dtype=torch.float8_e4m3fn), torch.ones(3, 7))
    with pytest.raises(ValueError, match="does not tile"):
        QuantLinear(64, 48, FP8, torch.float8_e4m3fn, (5, 1), torch.float32)
    with pytest.raises(ValueError, match="one scale row per weight row"):
        dequantize(torch.zeros(8, 16, dtype=torch.uint8), torch.ones(4, 1).to(E8M0))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize(torch.zeros(8, 16, dtype=torch.float8_e4m3fn), torch.ones(1))


def test_encoders_represent_their_own_output_exactly() -> None:
    """A dequantised weight re-encodes to the same values (its grid is powers of two), and the encoding
    error is that of e4m3 (3 mantissa bits) or e2m1 against the block's largest value."""
    w = torch.randn(200, 160) * 3
    for encode, bound in ((quantize_fp8, 2**-4), (quantize_fp4, 0.25)):
        once = dequantize(*encode(w))
        assert torch.equal(dequantize(*encode(once.float())), once)
        assert (once.float() - w).abs().max() / w.abs().max() <= bound


# --- native FP8 matmul (CUDA sm90+), DeepSeek's 1x128 activation / 128x128 weight recipe ---


def _fp8_layer(out: int = 256, n_in: int = 512) -> QuantLinear:
    q, s = quantize_fp8(torch.randn(out, n_in) / n_in**0.5)
    layer = QuantLinear(n_in, out, FP8, q.dtype, tuple(s.shape), s.dtype)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.scale.copy_(s)
    return layer


def test_activation_quantization_uses_power_of_two_scales_per_128() -> None:
    x = torch.randn(3, 256) * torch.tensor([1e-3] * 128 + [50.0] * 128)
    xq, scale = fp8_matmul.quantize_activations(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    back = (xq.float().unflatten(-1, (2, 128)) * scale[..., None]).flatten(-2)
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale.repeat_interleave(128, 1) * 2**-9).all()


def test_emulated_fp8_product_is_close_to_the_dequantised_one() -> None:
    layer = _fp8_layer()
    x = torch.randn(5, 512)
    got = fp8_matmul.emulated(*fp8_matmul.quantize_activations(x), layer.weight, scale_values(layer.scale))
    dense = F.linear(x, layer.dense_weight(torch.float32))
    assert (got - dense).abs().max() <= 0.05 * dense.abs().max()  # e4m3 activations: 3 mantissa bits


def test_native_fp8_falls_back_to_dequantising_where_torch_refuses(caplog: pytest.LogCaptureFixture) -> None:
    layer = _fp8_layer()
    x = torch.randn(4, 512).bfloat16()
    if not fp8_matmul.device_supported(x.device):
        assert not layer.enable_native_fp8() and layer.native_fp8 == "off"
        layer.native_fp8 = "unchecked"  # as if the device were supported: torch refuses blockwise on CPU
        with caplog.at_level("WARNING"):
            assert torch.equal(layer(x), F.linear(x, layer.dense_weight(torch.bfloat16)))
        assert layer.native_fp8 == "off" and "native FP8 matmul unavailable" in caplog.text


def _strict_scaled_mm(
    xq: torch.Tensor,
    w_t: torch.Tensor,
    x_scale: torch.Tensor,
    x_recipe: object,
    w_scale_t: torch.Tensor,
    w_recipe: object,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """``F.scaled_mm`` with blockwise scales as cuBLASLt takes them on an H200: the activations' scale
    columns must start 16-byte aligned (seen: M = 7 refused with CUBLAS_STATUS_NOT_SUPPORTED)."""
    if x_scale.stride(1) * x_scale.element_size() % 16:
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    return fp8_matmul.emulated(xq, x_scale, w_t.T, w_scale_t.T).to(output_dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])
def test_native_fp8_pads_rows_to_aligned_scale_columns(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    monkeypatch.setattr(F, "scaled_mm", _strict_scaled_mm, raising=False)
    monkeypatch.setattr(
        F, "ScalingType", type("S", (), {"BlockWise1x128": 0, "BlockWise128x128": 1}), raising=False
    )
    layer = _fp8_layer()
    xq, sx = fp8_matmul.quantize_activations(torch.randn(rows, 512))
    w_scale = scale_values(layer.scale)
    got = fp8_matmul.native(xq, sx, layer.weight, w_scale, torch.float32)
    want = fp8_matmul.emulated(xq, sx, layer.weight, w_scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # a 1-row GEMV rounds unlike a GEMM


def test_a_later_native_fp8_refusal_dequantises_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Checked once at its first shape, a layer may meet a shape cuBLAS refuses: that step dequantises."""
    layer = _fp8_layer()
    layer.native_fp8 = "on"

    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(fp8_matmul, "native", refuse)
    x = torch.randn(3, 512).bfloat16()
    with caplog.at_level("WARNING"):
        assert torch.equal(layer(x), F.linear(x, layer.dense_weight(torch.bfloat16)))
    assert layer.native_fp8 == "off" and "refused" in caplog.text


@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_matmul.device_supported(torch.device("cuda")),
    reason="needs a CUDA device of compute capability 9.0+",
)
@pytest.mark.parametrize("rows", [(7,), (8, 7), (1, 2, 128)])
def test_native_fp8_matmul_agrees_with_its_float32_arithmetic_on_cuda(rows: tuple[int, ...]) -> None:
    """Every row count multiplies natively, whichever came first (the first call checks the layer)."""
    layer = _fp8_layer().to("cuda")
    assert layer.enable_native_fp8()
    for m in rows:
        x = torch.randn(m, 512, device="cuda").bfloat16()
        first, again = layer(x), layer(x)
        assert layer.native_fp8 == "on" and torch.equal(first, again)
        ref = fp8_matmul.emulated(
            *fp8_matmul.quantize_activations(x), layer.weight, scale_values(layer.scale)
        )
        torch.testing.assert_close(first.float(), ref, atol=2e-2, rtol=2e-2)
