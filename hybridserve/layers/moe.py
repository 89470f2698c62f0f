"""DeepSeek-V4 mixture of experts: hash-routed or sqrt-softplus top-k, plus a shared expert."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.layers.gather import gather_rows


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


ALL_EXPERTS_MAX_WASTE = 4  # E / k: how many times the needed flops running every expert may cost
ALL_EXPERTS_MAX_ROWS = 256  # T * E: above this many (token, expert) rows a step runs grouped
# One layer's routed experts: bigger ones stream E / k times the bytes a step needs (the GEMMs are then
# memory-bound, not call-bound), and their flat copies would cost real memory.
ALL_EXPERTS_MAX_BYTES = 8 << 20
# Whether the graph being traced may take the all-experts form. Dynamo reads it as a guarded constant:
# the prefill graph, traced and run without it (``without_all_experts``), is one graph, not one per side
# of the token-count guard (its few-token steps are rare: a verify step or a decode takes a decode graph).
_all_experts_in_graphs = True


@contextmanager
def without_all_experts() -> Iterator[None]:
    """Compiled steps traced or run inside never run every routed expert (``Experts.prepare_all_experts``)."""
    global _all_experts_in_graphs
    _all_experts_in_graphs = False
    try:
        yield
    finally:
        _all_experts_in_graphs = True


def _grouped_outputs(
    x: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    offs: torch.Tensor,
    order: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Rows sorted by expert (``order``, group ends ``offs``) through one grouped matmul per weight;
    -> each (token, slot)'s expert output [T, k, D]."""
    rows = gather_rows(x, order // experts.shape[1])
    gate, up = F.grouped_mm(rows, gate_up.mT, offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(clamped_swiglu(gate, up, limit), down.mT, offs=offs)
    # Back to (token, slot) order by gathering through the inverse permutation: an exact row gather, 2.5x
    # faster on CPU than scattering with index_copy_ (1,024 x 192 floats: 34 vs 87 us).
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return gather_rows(y, inverse).view(*experts.shape, y.shape[-1])


@torch.library.custom_op("hybridserve::grouped_experts", mutates_args=())
def grouped_experts(
    x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    """Every (token, slot)'s expert output [T, k, D], one group per expert. An opaque op, so that a
    compiled CPU step runs fp32 experts grouped too (dynamo traces ``grouped_mm`` in bf16 only)."""
    sorted_ids, order = experts.flatten().sort(stable=True)
    ids = torch.arange(gate_up.shape[0], device=experts.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)
    return _grouped_outputs(x, experts, gate_up, down, offs, order, limit)


@grouped_experts.register_fake
def _grouped_experts_shape(
    x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    return x.new_empty(*experts.shape, x.shape[-1])


def _grouped_mm_is_async(x: torch.Tensor, hidden: int, inter: int) -> bool:
    """Whether ``F.grouped_mm`` runs here without a host sync: on CPU, and in bf16 on sm90/sm100 (its
    CUTLASS kernel); elsewhere torch falls back to copying the offsets to the host. Rows must be 16-byte
    aligned, and torch.compile traces it in bf16 only."""
    if (hidden * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        return False
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False
    if x.device.type == "cpu":
        return True
    is_cuda_bf16 = x.device.type == "cuda" and x.dtype == torch.bfloat16
    return is_cuda_bf16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)


class Experts(nn.Module):
    """Routed experts stored stacked: ``gate_up`` [E, 2I, D] (w1 then w3) and ``down`` [E, D, I].

    A fixed number of ops whatever experts are hit, with no host sync (static shapes given T).
    """

    # Whether a compiled CPU step may run ``weights(None)`` through the opaque grouped_experts op.
    compiled_grouped_op = True
    # Whether a compiled CPU step may run every expert on every token (``prepare_all_experts``).
    compiled_all_experts = True

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.gate_up = _weight(n_experts, 2 * inter, hidden)
        self.down = _weight(n_experts, hidden, inter)
        self.hidden, self.inter, self.limit = hidden, inter, limit
        self.all_experts: tuple[torch.Tensor, torch.Tensor] | None = None  # see prepare_all_experts

    def prepare_all_experts(self, top_k: int) -> bool:
        """Let compiled CPU steps of few tokens run every expert on every token in two GEMMs (flat fp32
        copies of the weights: ``[D, E * 2I]`` and ``[E * I, D]``), where that wastes at most ``E / k <= 4``
        times the flops: with one small GEMM per expert hit, a decode step of 16 tokens spent about 40% of
        its time in the experts. -> whether it applies (fp32 on CPU, few experts per pick, small experts:
        ``ALL_EXPERTS_MAX_BYTES``)."""
        n, inter, hidden = self.gate_up.shape[0], self.inter, self.hidden
        fp32_cpu = self.gate_up.dtype == torch.float32 and self.gate_up.device.type == "cpu"
        nbytes = (self.gate_up.numel() + self.down.numel()) * self.gate_up.element_size()
        small = nbytes <= ALL_EXPERTS_MAX_BYTES
        if not (self.compiled_all_experts and fp32_cpu and small and n <= ALL_EXPERTS_MAX_WASTE * top_k):
            return False
        with torch.inference_mode(False):  # compiled graphs take no inference tensors
            gate_up = self.gate_up.detach().permute(2, 0, 1).reshape(hidden, n * 2 * inter).contiguous()
            down = self.down.detach().permute(0, 2, 1).reshape(n * inter, hidden).contiguous()
        self.all_experts = (gate_up, down)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Each token sums its experts' outputs one by one in x's dtype, in ascending expert id order
        (ties by slot): a fixed order, independent of the other tokens. A compiled CPU step of few tokens
        may run all experts instead (``prepare_all_experts``; equal to float32 rounding)."""
        if self._runs_all_experts(x):
            return self._all_experts_weighted(x, weights, indices)
        experts, slot = indices.sort(dim=1, stable=True)
        y = self._expert_outputs(x, experts)
        terms = (y * weights.gather(1, slot)[..., None]).to(x.dtype)
        return functools.reduce(torch.add, terms.unbind(1))

    def _runs_all_experts(self, x: torch.Tensor) -> bool:
        """In a graph traced with the token count dynamic this is a guard (T <= rows / E): the runner warms
        up a batch on each side (``DecodeGraphRunner.warmup``)."""
        if self.all_experts is None or not torch.compiler.is_compiling() or x.device.type != "cpu":
            return False
        if not _all_experts_in_graphs:
            return False
        return x.shape[0] * self.gate_up.shape[0] <= ALL_EXPERTS_MAX_ROWS

    def _all_experts_weighted(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token, the unpicked ones weighted 0, summed by the down GEMM -> [T, D]."""
        assert self.all_experts is not None
        gate_up, down = self.all_experts
        t, n = x.shape[0], self.gate_up.shape[0]
        gate, up = (x @ gate_up).view(t, n, 2 * self.inter).chunk(2, dim=-1)
        # scatter_add: a hash table may pick one expert twice, whose weights then add up
        picked = torch.zeros(t, n, dtype=weights.dtype, device=x.device).scatter_add_(1, indices, weights)
        hidden = clamped_swiglu(gate, up, self.limit) * picked[..., None].to(x.dtype)
        return hidden.view(t, n * self.inter) @ down

    def _expert_outputs(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[T, D], expert ids [T, k] -> each (token, slot)'s expert output [T, k, D]. Chosen by device,
        dtype and shapes only: grouped where that has no host sync; else gathered weights while their T*k
        copies are fewer than the experts, else every expert on every token."""
        if self._compiled_on_cpu(x):
            return grouped_experts(x, experts, self.gate_up, self.down, self.limit)
        if _grouped_mm_is_async(x, self.hidden, self.inter):
            return self._grouped(x, experts)
        if experts.numel() < self.gate_up.shape[0]:
            return self._gathered(x, experts)
        return self._dense(x, experts)

    def _compiled_on_cpu(self, x: torch.Tensor) -> bool:
        aligned = (self.hidden * x.element_size()) % 16 == 0 and (self.inter * x.element_size()) % 16 == 0
        on_cpu = x.device.type == "cpu" and torch.compiler.is_compiling()
        return on_cpu and aligned and self.compiled_grouped_op

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, one grouped matmul per weight (per expert the same matmul as a loop
        over experts would do); the group offsets stay on the device."""
        sorted_ids, order = experts.flatten().sort(stable=True)
        ids, offs = self._groups(sorted_ids)
        gate_up, down = self.weights(ids)
        return _grouped_outputs(x, experts, gate_up, down, offs, order, self.limit)

    def _groups(self, sorted_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(weights' experts, None for all; group end offsets) of rows sorted by expert: one group each."""
        ids = torch.arange(self.gate_up.shape[0], device=sorted_ids.device, dtype=sorted_ids.dtype)
        return None, torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)

    def weights(self, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up`` and ``down`` of experts ``ids`` (any shape; every expert when None)."""
        if ids is None:
            return self.gate_up, self.down
        return self.gate_up[ids], self.down[ids]

    def _gathered(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) row times its own copy of its expert's weights: T*k copies, for few rows."""
        gate_up, down = self.weights(experts)
        gate, up = (x[:, None, None, :] @ gate_up.mT).chunk(2, dim=-1)
        return (clamped_swiglu(gate, up, self.limit) @ down.mT).squeeze(2)

    def _dense(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's own picked: E/k times the flops needed."""
        gate_up, down = self.weights(None)
        gate, up = (x @ gate_up.mT).chunk(2, dim=-1)
        y = (clamped_swiglu(gate, up, self.limit) @ down.mT).transpose(0, 1)
        return y.gather(1, experts[..., None].expand(-1, -1, y.shape[-1]))


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


def prepare_all_experts(model: nn.Module) -> int:
    """``Experts.prepare_all_experts`` on every MoE's routed experts -> how many it applies to."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    return sum(m.experts.prepare_all_experts(m.gate.top_k) for m in moes)
