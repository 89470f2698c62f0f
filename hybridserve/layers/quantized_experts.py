"""Routed experts whose weights stay FP8 / FP4 in memory; a call dequantises only the experts it uses."""

from __future__ import annotations

import torch

from hybridserve.layers.moe import Experts
from hybridserve.layers.quantized_linear import quantized_parameter, stored_shape
from hybridserve.layers.quantized_weight import block_edges, dequantize


class QuantizedExperts(Experts):
    """``gate_up`` [E, 2I, D] holds w1's rows then w3's, each with its own scale grid (stacked the same
    way in ``gate_up_scale``); ``down`` [E, D, I] with ``down_scale``. Stored FP8, or FP4 packed along
    the last dimension.

    Which experts get dequantised is decided by shapes alone (no host sync): the T*k picked (token,
    slot) experts while they are fewer than E (duplicates included), else all E. Their values are
    exactly those of the dense model's weights, so outputs are bit-equal to it.
    """

    compiled_grouped_op = False  # the op takes plain weights; these are dequantised per step
    compiled_all_experts = False  # a flat fp32 copy would undo the quantised storage

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        inter: int,
        limit: float,
        fmt: str,
        weight_dtype: torch.dtype,
        scales: tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]],
        dtype: torch.dtype,
    ) -> None:
        """``scales``: (shape, dtype) of one expert's w1 (= w3) and w2 scale grids; ``dtype``: the
        model's, which the dense experts would have."""
        super().__init__(n_experts, hidden, inter, limit)
        self.fmt, self.dtype = fmt, dtype
        (w1_scale, dtype13), (w2_scale, dtype2) = scales
        w1 = stored_shape((inter, hidden), fmt)
        w2 = stored_shape((hidden, inter), fmt)
        block_edges(w1, w1_scale, fmt)
        block_edges(w2, w2_scale, fmt)
        self.gate_up = quantized_parameter((n_experts, 2 * w1[0], w1[1]), weight_dtype)
        self.gate_up_scale = quantized_parameter((n_experts, 2 * w1_scale[0], w1_scale[1]), dtype13)
        self.down = quantized_parameter((n_experts, *w2), weight_dtype)
        self.down_scale = quantized_parameter((n_experts, *w2_scale), dtype2)

    def _groups(self, sorted_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Fewer rows than experts: one group per row, each with its row's expert's weights; an expert's
        rows all go to the group of its first row (its end is the end of that expert's rows), the groups
        of its later rows are empty."""
        if sorted_ids.numel() >= self.gate_up.shape[0]:
            return super()._groups(sorted_ids)
        return sorted_ids, torch.searchsorted(sorted_ids, sorted_ids, right=True, out_int32=True)

    def weights(self, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        parts: tuple[torch.Tensor, ...] = (self.gate_up, self.gate_up_scale, self.down, self.down_scale)
        if ids is not None:
            parts = tuple(p[ids] for p in parts)
        gu, gu_s, dn, dn_s = parts
        halves = dequantize(gu.unflatten(-2, (2, -1)), gu_s.unflatten(-2, (2, -1))).flatten(-3, -2)
        return halves.to(self.dtype), dequantize(dn, dn_s).to(self.dtype)
