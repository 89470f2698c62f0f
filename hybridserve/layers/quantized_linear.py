"""A bias-free linear whose weight stays FP8 / FP4 in memory and is dequantised at each use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers import fp8_matmul
from hybridserve.layers.quantized_weight import FP4, FP8, block_edges, dequantize, scale_values


def quantized_parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A parameter ``cast_`` leaves in its stored dtype."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.quantized = True  # type: ignore[attr-defined]
    return p


def stored_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """Stored shape of a dense ``shape`` weight: FP4 packs two values per byte along the last dimension."""
    if fmt == FP4:
        if shape[-1] % 2:
            raise ValueError(f"an FP4 weight needs an even last dimension, not {shape[-1]}")
        return (*shape[:-1], shape[-1] // 2)
    return tuple(shape)


class QuantLinear(nn.Module):
    """``y = x @ W.T`` with W held as ``weight`` (float8_e4m3fn, or packed e2m1 as uint8) and ``scale``.

    The dense weight exists only for the call: dequantised to bfloat16 (exactly what dequantising at
    load gives), then to x's dtype, so logits are bit-equal to a model loaded dense. After
    ``enable_native_fp8`` (CUDA sm90+), bfloat16 inputs multiply natively in FP8 instead.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        weight_dtype: torch.dtype,
        scale_shape: tuple[int, ...],
        scale_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        shape = stored_shape((out_features, in_features), fmt)
        self.blocks = block_edges(shape, scale_shape, fmt)
        self.weight = quantized_parameter(shape, weight_dtype)
        self.scale = quantized_parameter(scale_shape, scale_dtype)

        self.native_fp8 = "off"  # "unchecked" once enable_native_fp8 accepts it, then "on" or "off"

    def enable_native_fp8(self) -> bool:
        """Multiply natively in FP8 from now on if this device and shape allow it (see ``fp8_matmul``)."""
        ok = self.fmt == FP8 and fp8_matmul.device_supported(self.weight.device)
        ok = ok and fp8_matmul.shape_supported(self.out_features, self.in_features, self.blocks)
        self.native_fp8 = "unchecked" if ok else "off"
        return ok

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_fp8 != "off" and x.dtype == torch.bfloat16:
            y = self._native(x.reshape(-1, self.in_features))
            if y is not None:
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dense_weight(x.dtype))

    def _native(self, x: torch.Tensor) -> torch.Tensor | None:
        w_scale = scale_values(self.scale)
        if self.native_fp8 == "on":
            try:
                return fp8_matmul.native(*fp8_matmul.quantize_activations(x), self.weight, w_scale, x.dtype)
            except (RuntimeError, ValueError) as exc:  # a shape the first call did not have; fail no step
                fp8_matmul.logger.warning("%r: native FP8 matmul refused %s; dequantising", self, exc)
                self.native_fp8 = "off"
                return None
        y = fp8_matmul.checked_native(x, self.weight, w_scale, repr(self))
        self.native_fp8 = "on" if y is not None else "off"
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.fmt}, blocks={self.blocks}"


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight of a plain or a quantized linear, in ``dtype``."""
    if isinstance(layer, QuantLinear):
        return layer.dense_weight(dtype)
    assert isinstance(layer, nn.Linear)
    return layer.weight


__all__ = ["FP4", "FP8", "QuantLinear", "dense_weight", "quantized_parameter", "stored_shape"]
