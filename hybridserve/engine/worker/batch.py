"""Builds the step's ForwardBatch from the scheduler's output and the block tables.

Everything is gathered into Python lists first and crosses to the device in two transfers: one for the
per-token and per-request ints, one for every group's block table.
"""

from __future__ import annotations

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor


def build_forward_batch(
    scheduled: list[ScheduledRequest],
    coordinator: KvCacheCoordinator,
    device: torch.device,
    pad_windows: bool = False,
) -> ForwardBatch:
    """``pad_windows``: static shapes for a decode batch of a given size (see ``BatchLayout``)."""
    ids: list[int] = []
    positions: list[int] = []
    req_indices: list[int] = []
    logits_indices: list[int] = []
    for r, s in enumerate(scheduled):
        ids += s.token_ids if s.num_spec else s.request.all_token_ids[s.start : s.end]
        positions += range(s.start, s.end)
        req_indices += [r] * s.num_tokens
        if s.samples:  # the last known token's logits, then one per draft (verification)
            logits_indices += range(len(ids) - 1 - s.num_spec, len(ids))
    layout = BatchLayout(tuple(s.start for s in scheduled), tuple(s.end for s in scheduled), pad_windows)
    host = host_tensor(ids + positions + req_indices + list(layout.ends) + logits_indices)
    sizes = [len(ids)] * 3 + [len(scheduled), len(logits_indices)]
    input_ids, pos, req, ends, logits = host.to(device).split(sizes)
    tables = [coordinator.block_tables(s.request.request_id) for s in scheduled]
    return ForwardBatch(
        input_ids=input_ids,
        positions=pos,
        req_indices=req,
        seq_ends=ends,
        block_tables=block_table_tensors(tables, device),
        block_tokens=coordinator.block_tokens,
        logits_indices=logits,
        layout=layout,
    )


def block_table_tensors(tables: list[dict[str, list[int]]], device: torch.device) -> dict[str, torch.Tensor]:
    """Every group's [R, width] table (null-padded to the longest row of any group), one transfer."""
    names = list(tables[0])
    width = max(1, *(len(t[name]) for t in tables for name in names))
    flat: list[int] = []
    for name in names:
        for t in tables:
            row = t[name]
            flat += row
            flat += [0] * (width - len(row))
    packed = host_tensor(flat).to(device).view(len(names), len(tables), width)
    return dict(zip(names, packed.unbind(0), strict=True))
