"""The expert-parallel MoE layer: routed experts split over the ranks in contiguous ranges, tokens
dispatched to their experts' rank and the outputs combined back (``distributed/expert_dispatch.py``).

Shared experts, router and attention stay replicated; only ``Experts`` changes. Each rank holds
only its own range's weights (``ExpertShard.weights`` drops the others at load time).

Output does not depend on the world size beyond fp32 rounding: each (token, slot)'s expert output
comes back to the token's own rank unchanged (a copy), and that rank weights and sums the slots
exactly as single-process ``Experts.forward`` does (ascending expert id, ties by slot, in x's dtype).
What differs is only inside the expert GEMMs: a rank multiplies an expert's weights by the rows it
received, at other offsets of a differently sized grouped matmul, and CPU/GPU GEMM kernels pick their
accumulation order by tile position. So each expert output element is the same dot product summed in
another order: |dy| <= gamma_D * sum_i |x_i w_i| (gamma_n = n*eps/(1-n*eps), eps = 2^-24 in fp32), then
the same with I for the down projection; nothing else changes. With one rank the outputs are
bit-equal; tests/distributed measure the logits of 2 and 3 ranks (<= 3e-6 on the tiny models).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hybridserve.distributed.expert_dispatch import ExpertDispatcher, ExpertRange
from hybridserve.distributed.group import ProcessGroup
from hybridserve.layers.moe import Experts, MoE

_EXPERT_NAME = re.compile(r"(\.ffn\.experts\.)(\d+)(\.)")


class ParallelExperts(Experts):
    """This rank's experts; ``_expert_outputs`` runs every (token, slot) on its expert's rank."""

    compiled_all_experts = False  # every (token, slot) goes to its expert's rank

    def __init__(
        self, experts: ExpertRange, group: ProcessGroup, hidden: int, inter: int, limit: float
    ) -> None:
        super().__init__(experts.end - experts.start, hidden, inter, limit)
        self.range = experts
        self.group = group
        self.dispatcher = ExpertDispatcher(experts, group)
        self.tokens_per_expert = [0] * (experts.end - experts.start)  # rows this rank's experts ran
        self.calls = 0  # dispatch / combine rounds joined

    def _expert_outputs(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rows, local_ids, route = self.dispatcher.dispatch(x, experts)
        self._count(local_ids)
        y = super()._expert_outputs(rows, local_ids[:, None])[:, 0] if rows.shape[0] else rows
        return self.dispatcher.combine(y, route)

    @property
    def comm_s(self) -> float:
        """Time in this layer's dispatch / combine collectives."""
        return self.dispatcher.comm_s

    def _count(self, local_ids: torch.Tensor) -> None:
        counts = torch.bincount(local_ids, minlength=len(self.tokens_per_expert)).tolist()
        self.tokens_per_expert = [a + b for a, b in zip(self.tokens_per_expert, counts, strict=True)]


@dataclass
class ExpertShard:
    """How one rank's copy of the model differs from the full one: its experts only."""

    group: ProcessGroup

    def range_for(self, num_experts: int) -> ExpertRange:
        return ExpertRange(self.group.rank, self.group.world_size, num_experts)

    def apply(self, model: nn.Module) -> None:
        """Swap every MoE's ``Experts`` for this rank's ``ParallelExperts`` (before weights exist)."""
        for module in model.modules():
            if isinstance(module, MoE) and not isinstance(module.experts, ParallelExperts):
                full = module.experts
                num_experts, two_inter, hidden = full.gate_up.shape
                with torch.device(full.gate_up.device):
                    module.experts = ParallelExperts(
                        self.range_for(num_experts), self.group, hidden, two_inter // 2, full.limit
                    )

    def weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], num_experts: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors this rank keeps, expert ids renumbered from 0 in its range."""
        owned = self.range_for(num_experts)
        for name, tensor in tensors:
            m = _EXPERT_NAME.search(name)
            if m is None:
                yield name, tensor
            elif owned.start <= int(m.group(2)) < owned.end:
                yield name[: m.start(2)] + str(int(m.group(2)) - owned.start) + name[m.end(2) :], tensor


def weight_bytes_per_rank(model: nn.Module, world_size: int) -> list[int]:
    """Bytes of weights each of ``world_size`` expert-parallel ranks holds: everything but the routed
    experts on every rank, plus its own range of each MoE's experts. Works on a meta model."""
    tensors = list(model.parameters()) + list(model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    moes = [m.experts for m in model.modules() if isinstance(m, MoE)]
    per_expert = sum((e.gate_up[0].numel() + e.down[0].numel()) * e.gate_up.element_size() for e in moes)
    num_experts = moes[0].gate_up.shape[0] if moes else 0
    replicated = total - per_expert * num_experts
    if world_size == 1 or not moes:
        return [total] * world_size
    return [replicated + per_expert * (end - start) for start, end in expert_shards(model, world_size)]


def expert_shards(model: nn.Module, world_size: int) -> list[tuple[int, int]]:
    """The routed experts ``[start, end)`` each of ``world_size`` expert-parallel ranks holds (every MoE
    layer alike; ``(0, 0)`` on a model without routed experts). Works on a meta model."""
    moes = [m.experts for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return [(0, 0)] * world_size
    num_experts = moes[0].gate_up.shape[0]
    return [ExpertRange(r, world_size, num_experts).bounds(r) for r in range(world_size)]


def parallel_experts(modules: Iterable[nn.Module]) -> list[ParallelExperts]:
    """The parallel experts among ``modules`` (a model's ``modules()``)."""
    return [m for m in modules if isinstance(m, ParallelExperts)]


def run_dummy_moe(layers: nn.ModuleList, hidden: int, device: torch.device, dtype: torch.dtype) -> None:
    """What a rank with no tokens runs so the others' dispatch and combine can complete: every MoE
    layer, in forward order, on zero rows."""
    x = torch.empty(0, hidden, device=device, dtype=dtype)
    ids = torch.empty(0, device=device, dtype=torch.long)
    with torch.inference_mode():
        for layer in layers:
            moe = layer.get_submodule("ffn")
            assert isinstance(moe, MoE)
            moe(x, ids)


def draft_moe(modules: Iterable[nn.Module], trunk: nn.ModuleList) -> MoE | None:
    """The first MoE outside the trunk's layers: the draft (MTP) layer's, the one drafting runs."""
    inside = {id(m) for m in trunk.modules()}
    return next((m for m in modules if isinstance(m, MoE) and id(m) not in inside), None)


@dataclass
class DraftCollectives:
    """The draft (MTP) layer's MoE joins its dispatch and combine ``per_step`` times on every rank each
    step: drafting k tokens runs the layer up to k times, so a rank that ran it fewer times (shorter
    chains, no drafting request, or a dummy step) runs it on zero rows until it has ``per_step``."""

    moe: MoE
    per_step: int
    hidden: int
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self._mark = 0

    def begin(self) -> None:
        self._mark = self._calls()

    def complete(self) -> None:
        x = torch.empty(0, self.hidden, device=self.device, dtype=self.dtype)
        ids = torch.empty(0, device=self.device, dtype=torch.long)
        with torch.inference_mode():
            for _ in range(self.per_step - (self._calls() - self._mark)):
                self.moe(x, ids)

    def _calls(self) -> int:
        experts = self.moe.experts
        return experts.calls if isinstance(experts, ParallelExperts) else 0
