"""Row gathers: ``source[index]`` for an integer ``index`` of any shape, by ``index_select`` in eager code.

Both give the same rows (a gather is exact). On CPU, advanced indexing copies element by element while
``index_select`` copies whole rows: 4-5x faster for the cache's row reads (8,192 rows of 64 floats from a
pool: 1.37 ms vs 0.28 ms on this project's CPU machine). Traced code keeps the indexing: inductor makes its
own gather of either, and the compiled decode step measured slower with ``index_select`` (batch 16:
3.46-3.54 -> 3.57-3.60 ms a graph). Indices must be in range, not negative.

A cache's rows may also come as a :class:`RowStore` (an arena's ``cache.flat_rows.FlatRows``, what
compiled steps take); ``gather_rows`` and ``put_rows`` take either.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowStore(Protocol):
    """Rows ``[N, width]`` kept somewhere other than one tensor of that shape."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def gather(self, index: torch.Tensor) -> torch.Tensor: ...

    def put(self, slots: torch.Tensor, values: torch.Tensor) -> None: ...

    def strided(self) -> torch.Tensor: ...


Rows = torch.Tensor | RowStore


def gather_rows(source: Rows, index: torch.Tensor) -> torch.Tensor:
    """``source[index]``: rows of ``source`` [N, ...] at ``index`` (any shape) -> [*index.shape, ...]."""
    if not isinstance(source, torch.Tensor):
        return source.gather(index)
    if torch.compiler.is_compiling():
        return source[index]
    return source.index_select(0, index.reshape(-1)).view(*index.shape, *source.shape[1:])


def put_rows(target: Rows, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``target[slots] = values``, in place."""
    if isinstance(target, torch.Tensor):
        target.index_put_((slots,), values)
    else:
        target.put(slots, values)
