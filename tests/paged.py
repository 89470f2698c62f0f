"""Our paged model driven directly, one request, explicit chunks (no scheduler)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.layers.forward_batch import ForwardBatch
from hybridserve.models.loader import ModelShard, load_model


class PagedSequence:
    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype,
        block_tokens: int,
        num_blocks: int = 64,
        keep_quantized: bool = True,
        kv_cache_dtype: str = "auto",
        shard: ModelShard | None = None,
    ) -> None:
        self.model = load_model(folder, dtype, "cpu", keep_quantized, shard=shard)
        specs = self.model.cache_specs(kv_cache_dtype=kv_cache_dtype)
        plan = build_plan(specs, block_tokens, 4, 512, num_blocks=num_blocks)
        self.pools = BlockPoolSet(plan, "cpu")
        self.coordinator = KvCacheCoordinator(plan, self.pools, enable_prefix_caching=False)
        self.block_tokens = block_tokens

    def logits(self, token_ids: list[int], chunks: list[int], request_id: str = "r") -> torch.Tensor:
        out, pos = [], 0
        for c in chunks:
            assert self.coordinator.allocate(request_id, pos, pos + c)
            tables = self.coordinator.block_tables(request_id)
            batch = ForwardBatch(
                input_ids=torch.tensor(token_ids[pos : pos + c]),
                positions=torch.arange(pos, pos + c),
                req_indices=torch.zeros(c, dtype=torch.long),
                seq_ends=torch.tensor([pos + c]),
                block_tables={g: torch.tensor([t]) for g, t in tables.items()},
                block_tokens=self.block_tokens,
                logits_indices=torch.arange(c),
            )
            out.append(self.model.compute_logits(self.model(batch, self.pools.tensors())))
            pos += c
        self.coordinator.release(request_id)
        return torch.cat(out)
