"""RMS norms with DeepSeek-V4's dtype rules: statistics in float32, one cast at the end."""

from __future__ import annotations

import torch
from torch import nn


def keep_fp32(p: nn.Parameter) -> nn.Parameter:
    """Mark a parameter that stays float32 whatever the model dtype (the reference's rule)."""
    p.keep_fp32 = True  # type: ignore[attr-defined]
    return p


class RMSNorm(nn.Module):
    """Weighted RMS norm; the weight stays float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = keep_fp32(nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` as a function: statistics in float32, one cast back to ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
