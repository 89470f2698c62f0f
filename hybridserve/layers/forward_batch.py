"""ForwardBatch: the model's only view of a step's requests and of the cache layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One step's tokens for every scheduled request, flattened.

    ``block_tables[group]`` is [R, max_blocks] (0 = null block); logical block j of a request
    covers tokens [j * block_tokens, (j + 1) * block_tokens) in every group.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_indices: torch.Tensor  # [T] row of the request in the block tables
    seq_ends: torch.Tensor  # [R] position after the last token of each request in this step
    block_tables: dict[str, torch.Tensor]
    block_tokens: int
    logits_indices: torch.Tensor  # [N] token rows whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def slots(self, group: str, stride: int, rows: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        """Flat row indices of row numbers ``rows`` (tokens // stride) of requests ``req``."""
        per_block = self.block_tokens // stride
        table = self.block_tables[group]
        safe = rows.clamp(min=0)
        col = (safe // per_block).clamp(max=table.shape[1] - 1)
        return table[req, col] * per_block + safe % per_block
