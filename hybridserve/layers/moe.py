"""DeepSeek-V4 mixture of experts: hash-routed or sqrt-softplus top-k, plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _weight(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


_SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "softmax": lambda x: x.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class Router(nn.Module):
    """Scores experts; picks them by a fixed token-id table (hash) or by top-k of score + bias."""

    def __init__(
        self, hidden: int, n_experts: int, top_k: int, vocab: int, is_hash: bool, scoring: str, scaling: float
    ) -> None:
        super().__init__()
        self.weight = _weight(n_experts, hidden)
        self.is_hash = is_hash
        self.top_k = top_k
        self.scaling = scaling
        self.score_fn = _SCORE_FNS[scoring]
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k], expert indices [T, k])."""
        scores = self.score_fn(F.linear(x, self.weight))
        if self.is_hash:
            indices = self.get_buffer("tid2eid")[input_ids].long()
        else:
            bias = self.get_buffer("bias")
            indices = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up`` [E, 2I, D] (w1 then w3) and ``down`` [E, D, I]."""

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.gate_up = _weight(n_experts, 2 * inter, hidden)
        self.down = _weight(n_experts, hidden, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        order = torch.argsort(indices.flatten(), stable=True)
        counts = torch.bincount(indices.flatten(), minlength=self.gate_up.shape[0]).tolist()
        tokens = order // indices.shape[1]
        flat_w = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx, w = tokens[start : start + n], flat_w[start : start + n]
            start += n
            gate, up = F.linear(x[idx], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down[e]) * w[:, None]
            out.index_add_(0, idx, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        n_experts: int,
        top_k: int,
        vocab: int,
        is_hash: bool,
        scoring: str,
        scaling: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, vocab, is_hash, scoring, scaling)
        self.experts = Experts(n_experts, hidden, inter, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        return self.experts(x, weights, indices) + self.shared_experts(x)
