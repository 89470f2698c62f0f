"""Interleaved rotary embedding on the trailing slice of each head (DeepSeek-V4 layout)."""

from __future__ import annotations

import torch

from hybridserve.models.deepseek_v4_config import RopeConfig


class Rotary:
    """cos/sin tables for one rope set; positions are absolute token (or window) positions."""

    def __init__(self, rope: RopeConfig, device: torch.device | str) -> None:
        inv_freq, self.scale = rope.inv_freq()
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width tables ``[..., rope_dim // 2]``, rounded to ``dtype`` like the reference."""
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` in float32.

    ``cos``/``sin`` are ``[T, r/2]``; ``x`` is ``[T, ..., d]`` (any number of head dims).
    """
    extra = x.dim() - cos.dim()
    shape = (cos.shape[0],) + (1,) * extra + (cos.shape[-1] * 2,)
    cos = cos.repeat_interleave(2, dim=-1).reshape(shape)
    sin = sin.repeat_interleave(2, dim=-1).reshape(shape)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = (rope.float() * cos + _rotate_half(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
