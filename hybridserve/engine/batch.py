"""Builds the step's ForwardBatch from the scheduler's output and the block tables."""

from __future__ import annotations

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.engine.scheduler import ScheduledRequest
from hybridserve.layers.forward_batch import ForwardBatch


def build_forward_batch(
    scheduled: list[ScheduledRequest], coordinator: KvCacheCoordinator, device: torch.device
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    req_indices: list[int] = []
    logits_indices: list[int] = []
    for r, s in enumerate(scheduled):
        ids += s.request.all_token_ids[s.start : s.end]
        positions += range(s.start, s.end)
        req_indices += [r] * s.num_tokens
        if s.samples:
            logits_indices.append(len(ids) - 1)
    tables = [coordinator.block_tables(s.request.request_id) for s in scheduled]
    block_tables = {name: _pad([t[name] for t in tables]).to(device) for name in tables[0]}

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    return ForwardBatch(
        input_ids=tensor(ids),
        positions=tensor(positions),
        req_indices=tensor(req_indices),
        seq_ends=tensor([s.end for s in scheduled]),
        block_tables=block_tables,
        block_tokens=coordinator.block_tokens,
        logits_indices=tensor(logits_indices),
    )


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
