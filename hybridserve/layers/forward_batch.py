"""ForwardBatch: the model's only view of a step's requests and of the cache layout."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch


def host_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of Python ints, about 3x faster than ``torch.tensor(values)``."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


@dataclass(frozen=True)
class BatchLayout:
    """The step's requests as Python ints, so metadata shapes need no device read.

    Request r computes positions ``[starts[r], ends[r])``; its tokens are consecutive in the batch and
    the requests follow each other in order.
    """

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    # Pad the windows a step completes to ceil(n / m) per request of n tokens, so that a decode batch
    # of R requests always has the same shapes there (CUDA-graph capture); else exactly what completes.
    pad_windows: bool = False

    @classmethod
    def from_tensors(cls, req_indices: torch.Tensor, seq_ends: torch.Tensor) -> BatchLayout:
        """The layout of a hand-built batch (reads the tensors: a host sync)."""
        ends: list[int] = seq_ends.tolist()
        counts = torch.bincount(req_indices, minlength=len(ends)).tolist()
        return cls(tuple(e - n for e, n in zip(ends, counts, strict=True)), tuple(ends))


@dataclass
class ForwardBatch:
    """One step's tokens for every scheduled request, flattened (grouped by request, in order).

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
    layout: BatchLayout | None = None  # None: derived from the tensors on first use

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def host_layout(self) -> BatchLayout:
        if self.layout is None:
            self.layout = BatchLayout.from_tensors(self.req_indices, self.seq_ends)
        return self.layout

    def slots(
        self, group: str | list[str], stride: int, rows: torch.Tensor, req: torch.Tensor
    ) -> torch.Tensor:
        """Flat row indices of row numbers ``rows`` (tokens // stride) of requests ``req`` (broadcast).

        Several groups (their tables of one width) give one more leading dim, in their order.
        """
        per_block = self.block_tokens // stride
        if isinstance(group, str):
            table = self.block_tables[group]
        else:
            table = torch.stack([self.block_tables[g] for g in group])
        safe = rows.clamp(min=0)
        col = (safe // per_block).clamp(max=table.shape[-1] - 1)
        return table[..., req, col] * per_block + safe % per_block
