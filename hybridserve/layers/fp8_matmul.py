"""Native FP8 matmul (torch ``scaled_mm``) for FP8 block-scaled weights, DeepSeek's recipe: activations
quantized to e4m3 per 1x128 block with power-of-two (ue8m0) scales, weights per 128x128 block.

Used on CUDA devices of compute capability 9.0 and up, for weights whose both dimensions are whole
128-blocks. Not bit-equal to dequantising (the activations are rounded to e4m3), so a layer checks
its first native product against the same arithmetic done in float32 and, if torch refuses the
call or the two disagree, warns and dequantises from then on.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

BLOCK = 128
# cuBLASLt reads the activations' scale grid column by column, each column M floats long; a column that
# does not start 16-byte aligned (M not a multiple of 4) is refused (CUBLAS_STATUS_NOT_SUPPORTED, H200).
ROW_ALIGN = 4
_CHECK_RTOL = 2e-2
logger = logging.getLogger(__name__)


def device_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def shape_supported(out_features: int, in_features: int, blocks: tuple[int, int]) -> bool:
    """Whole 128-blocks; K in whole groups of four blocks, as cuBLAS lays out a 128x128 scale grid (so
    it needs no padding; DeepSeek's dimensions all qualify)."""
    return blocks == (BLOCK, BLOCK) and out_features % BLOCK == 0 and in_features % (4 * BLOCK) == 0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 power-of-two scales [M, K/128] that multiply back)."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2), scale


def emulated(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """The native product's arithmetic in float32: dequantise both operands, multiply."""
    x = (xq.float().unflatten(-1, (-1, BLOCK)) * x_scale[..., None]).flatten(-2)
    w = weight.float().unflatten(-1, (-1, BLOCK)).unflatten(0, (-1, BLOCK)) * w_scale[:, None, :, None]
    return x @ w.flatten(0, 1).flatten(-2).T


def native(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``scaled_mm`` of x [M, K] and weight.T [K, N] with blockwise scales laid out as torch's own samples
    lay them: x's [M, K/128] stored K-block-major, the weight's [K/128, N/128] as the transpose of the
    contiguous [N/128, K/128] grid. M is padded to a multiple of ``ROW_ALIGN`` (zero rows, unit scales)."""
    m, pad = xq.shape[0], -xq.shape[0] % ROW_ALIGN
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)  # zero bytes: e4m3 zeros
        x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
    recipe = F.ScalingType
    y = F.scaled_mm(
        xq,
        weight.T,
        x_scale.T.contiguous().T,
        recipe.BlockWise1x128,
        w_scale.contiguous().T,
        recipe.BlockWise128x128,
        output_dtype=dtype,
    )
    return y[:m]


def checked_native(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, name: str
) -> torch.Tensor | None:
    """The first native product of a layer, if torch runs it and it agrees with ``emulated``; else None."""
    xq, sx = quantize_activations(x)
    try:
        y = native(xq, sx, weight, w_scale, x.dtype)
    except (RuntimeError, ValueError) as exc:
        logger.warning("%s: native FP8 matmul unavailable (%s); dequantising its weight at use", name, exc)
        return None
    ref = emulated(xq, sx, weight, w_scale)
    err = float((y.float() - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
    if err > _CHECK_RTOL:
        logger.warning(
            "%s: native FP8 matmul off by %.3g relative; dequantising its weight at use", name, err
        )
        return None
    return y
