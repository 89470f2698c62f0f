"""What one kind of per-request state looks like: the unit the cache plan is built from."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class GroupKind(Enum):
    HISTORY = "history"  # every row since position 0 stays readable
    WINDOW = "window"  # only rows of the last `window_tokens` tokens must stay readable


@dataclass(frozen=True)
class RowField:
    """One tensor a layer keeps per row (e.g. the compressed KV, or the compressor gate inputs)."""

    name: str
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.width * self.dtype.itemsize


@dataclass(frozen=True)
class CacheGroupSpec:
    """A kind of state shared by several layers, addressed by one block table per request.

    ``stride`` is the number of tokens per row (1 for per-token state, m for compressed rows).
    For WINDOW groups, ``window_tokens`` is how many tokens before the next position to compute
    must still be readable; blocks entirely before that are recycled while the request runs.
    ``draft`` marks state of a speculative drafter (the MTP layer's window), kept beside the target
    model's groups in the same plan: allocated, zeroed, freed and prefix-cached with them.
    """

    name: str
    kind: GroupKind
    stride: int
    fields: tuple[RowField, ...]
    layers: tuple[str, ...]
    window_tokens: int = 0
    draft: bool = False

    def __post_init__(self) -> None:
        assert self.stride >= 1 and self.fields and self.layers
        assert self.kind is GroupKind.HISTORY or self.window_tokens >= 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one row across every layer and field of the group."""
        return sum(f.nbytes for f in self.fields) * len(self.layers)

    @property
    def bytes_per_token(self) -> float:
        return self.row_bytes / self.stride
