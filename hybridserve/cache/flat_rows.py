"""FlatRows: one cache tensor's rows addressed by element index in its arena's flat storage.

An arena group's cache tensors are strided views of one byte storage. Handed to ``torch.compile`` as
graph inputs they alias, which aot_autograd takes only through a synthetic base: every step then copies
the whole arena (about 4.5 s a batch-4 decode step of the bundled model, against 6 ms with the
fixed layout, on this project's CPU machine). Compiled steps take
these instead: every field of one dtype shares one flat tensor, the only graph input, and a row read or
write is a gather or an ``index_put_`` at ``offset + row * stride + column``, which inductor keeps in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class FlatRows:
    """Rows ``[rows, width]`` of one field: row r is ``flat[offset + r * stride :][:width]``."""

    flat: torch.Tensor  # the arena's bytes as this field's dtype, 1-D
    offset: int  # elements before row 0
    stride: int  # elements from one row to the next
    rows: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.width)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """``rows[index]`` for an integer ``index`` of any shape -> ``[*index.shape, width]``: a row
        gather from a strided view, which inductor copies a row at a time, vectorised (an element
        gather, as ``put`` needs, made a batch-16 decode step of the 72M checkpoint 15% slower)."""
        return self.strided()[index]

    def strided(self) -> torch.Tensor:
        """The rows as a strided view ``[rows, width]`` of the flat tensor (to read, never to write: a
        compiled step would copy the whole flat tensor to write through a view)."""
        return self.flat.as_strided((self.rows, self.width), (self.stride, 1), self.offset)

    def put(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """``rows[slots] = values`` (``values`` [len(slots), width])."""
        self.flat.index_put_((self._elements(slots),), values.to(self.flat.dtype))

    def _elements(self, index: torch.Tensor) -> torch.Tensor:
        cols = torch.arange(self.width, device=index.device)
        return self.offset + index.unsqueeze(-1) * self.stride + cols
