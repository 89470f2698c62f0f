"""One rope set's parameters (default or YaRN) and the inverse frequencies they give."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RopeConfig:
    """One rope set: a model may have several (DeepSeek-V4: ``main`` and ``compress``)."""

    theta: float
    rope_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @classmethod
    def from_params(
        cls, p: dict[str, Any], head_dim: int, partial_rotary_factor: float, max_pos: int, truncate: bool
    ) -> RopeConfig:
        """From a Hugging Face rope-parameters dict (``rope_type`` / ``type``, ``rope_theta``, YaRN keys)."""
        rope_type = str(p.get("rope_type", p.get("type", "default")))
        rope_dim = int(head_dim * float(p.get("partial_rotary_factor", partial_rotary_factor)))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, yarn)")
        if rope_type == "default":
            return cls(theta=float(p["rope_theta"]), rope_dim=rope_dim)
        factor = p.get("factor")
        original = int(p.get("original_max_position_embeddings") or max_pos)
        factor = float(factor) if factor is not None else max_pos / original
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = yarn_mscale(factor, p.get("mscale"), p.get("mscale_all_dim"))
        return cls(
            theta=float(p["rope_theta"]),
            rope_dim=rope_dim,
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
            truncate=truncate,
        )

    def inv_freq(self) -> tuple[list[float], float]:
        """Inverse frequencies (one per rotated pair) and the cos/sin scale."""
        dim = self.rope_dim
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.rope_type != "yarn":
            return (1.0 / pos_freqs).tolist(), 1.0
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range()
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        inv = interpolation * (1 - keep) + extrapolation * keep
        return inv.tolist(), self.attention_factor

    def _correction_range(self) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:
            ratio = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return (self.rope_dim * math.log(ratio)) / (2 * math.log(self.theta))

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.rope_dim - 1)


def yarn_mscale(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's attention scale when the config gives none (DeepSeek's ``mscale`` / ``mscale_all_dim``)."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)
