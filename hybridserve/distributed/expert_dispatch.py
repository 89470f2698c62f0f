"""Expert-parallel dispatch and combine: each (token, slot) row goes to the rank that owns its expert
and its output comes back to the token's rank, with ``all_to_all_single`` on the device group."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridserve.distributed.group import ProcessGroup


@dataclass(frozen=True)
class ExpertRange:
    """Rank ``rank`` of ``world_size`` owns experts ``[start, end)`` of ``num_experts``."""

    rank: int
    world_size: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= self.num_experts:
            raise ValueError(
                f"expert parallelism over {self.world_size} ranks needs at least that many routed experts; "
                f"the model has {self.num_experts} (lower --data-parallel-size)"
            )

    def bounds(self, rank: int) -> tuple[int, int]:
        """Contiguous ranges, the first ``E % N`` ranks one expert larger."""
        base, extra = divmod(self.num_experts, self.world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    @property
    def start(self) -> int:
        return self.bounds(self.rank)[0]

    @property
    def end(self) -> int:
        return self.bounds(self.rank)[1]

    def ends(self) -> list[int]:
        return [self.bounds(r)[1] for r in range(self.world_size)]


@dataclass
class Route:
    """How a dispatch sent its rows, so that combine can bring the outputs back in the same order."""

    order: torch.Tensor  # flat (token, slot) index of each row sent, grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    k: int


class ExpertDispatcher:
    def __init__(self, experts: ExpertRange, group: ProcessGroup) -> None:
        self.range = experts
        self.group = group
        self.comm_s = 0.0  # time in dispatch / combine collectives

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """x [tokens, hidden] and experts [tokens, k] -> the rows this rank's experts run, their expert
        ids counted from this rank's first expert, and the route back."""
        num_tokens, k = experts.shape
        flat = experts.flatten()
        ends = torch.tensor(self.range.ends(), device=x.device, dtype=flat.dtype)
        dest = torch.bucketize(flat, ends, right=True)
        order = dest.argsort(stable=True)
        send = torch.bincount(dest, minlength=self.range.world_size)
        ones = [1] * self.range.world_size
        recv = self._all_to_all(send, ones, ones)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        rows = self._all_to_all(x[order // k], recv_splits, send_splits)
        ids = self._all_to_all(flat[order], recv_splits, send_splits) - self.range.start
        return rows, ids, Route(order, send_splits, recv_splits, num_tokens, k)

    def combine(self, y: torch.Tensor, route: Route) -> torch.Tensor:
        """The outputs of ``dispatch``'s rows -> [tokens, k, hidden] on the tokens' own rank."""
        back = self._all_to_all(y.contiguous(), route.send_splits, route.recv_splits)
        out = torch.empty_like(back).index_copy_(0, route.order, back)
        return out.view(route.num_tokens, route.k, y.shape[-1])

    def _all_to_all(self, t: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv_splits), *t.shape[1:]))
        start = time.perf_counter()
        dist.all_to_all_single(out, t, recv_splits, send_splits, group=self.group.device_group)
        self.comm_s += time.perf_counter() - start  # on CUDA: time to enqueue, unless a sync follows
        return out
