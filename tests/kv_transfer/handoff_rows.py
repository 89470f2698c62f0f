"""What a KV handoff moves, read straight from the pool tensors (independent of pack / unpack)."""

from __future__ import annotations

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.kv_transfer.handoff import handoff_blocks


def moved_rows(
    pools: BlockPoolSet, coordinator: KvCacheCoordinator, rid: str, n: int
) -> dict[str, torch.Tensor]:
    """The rows of every block the handoff of ``rid``'s ``n`` tokens moves, per group, layer and field."""
    out = {}
    for name, blocks in handoff_blocks(pools.plan, n).items():
        r = pools[name].plan.rows_per_block
        for (layer, field), t in pools[name].tensors.items():
            b = [coordinator.block_tables(rid)[name][j] for j in blocks]
            out[f"{name}/{layer}/{field}"] = torch.cat([t[x * r : (x + 1) * r] for x in b]).clone()
    return out
