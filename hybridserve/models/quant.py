"""Dequantisation of DeepSeek FP8 (e4m3, block scales) and FP4 (e2m1 packed, ue8m0 per-32 scales) weights."""

from __future__ import annotations

import torch

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv", ".weight_scale")


def is_scale_tensor(name: str, names: set[str]) -> bool:
    """True for a scale that belongs to a quantised ``.weight`` next to it."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) + ".weight" in names:
            return True
    return False


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return torch.pow(2.0, scale.view(torch.uint8).float() - 127)
    return scale.float()


def _block(dim: int, blocks: int) -> int:
    """Block edge of a scale grid: DeepSeek's 128, or an exact division of the dimension."""
    if -(-dim // 128) == blocks:
        return 128
    if dim % blocks == 0:
        return dim // blocks
    raise ValueError(f"a scale grid of {blocks} blocks does not tile a dimension of {dim}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> bfloat16 weight of the logical shape."""
    s = _scale_values(scale)
    if weight.dtype == torch.float8_e4m3fn:
        out, n_in = weight.shape
        bo, bi = _block(out, s.shape[0]), _block(n_in, s.shape[1])
        full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n_in]
        return (weight.float() * full).to(torch.bfloat16)
    if weight.dtype in (torch.int8, torch.uint8):
        packed = weight.view(torch.uint8)
        table = torch.tensor(_E2M1, dtype=torch.float32)
        values = torch.stack([table[(packed & 0xF).long()], table[(packed >> 4).long()]], dim=-1).flatten(-2)
        block = values.shape[1] // s.shape[1]
        return (values * s.repeat_interleave(block, 1)).to(torch.bfloat16)
    raise ValueError(f"cannot dequantise a {weight.dtype} weight with a scale")
