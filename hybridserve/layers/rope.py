"""Interleaved rotary embedding on the trailing slice of each head (DeepSeek-V4 layout)."""

from __future__ import annotations

import torch

from hybridserve.layers.rope_config import RopeConfig

_MIN_TABLE = 1024


class Rotary:
    """cos/sin tables for one rope set; positions are absolute token (or window) positions.

    The tables (float32, already times ``scale``) cover positions ``[0, table_size)`` and double when a
    larger position shows up; each entry is computed with the very ops of the direct formula, so a
    lookup is bit-identical to it. Finding the largest position costs a host sync off the CPU.
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str) -> None:
        inv_freq, self.scale = rope.inv_freq()
        self.inv_freq = torch.tensor(inv_freq, dtype=torch.float32, device=device)
        self._table = self._cos_sin_fp32(torch.arange(0, device=self.inv_freq.device))

    @property
    def table_size(self) -> int:
        return self._table.shape[0]

    def _cos_sin_fp32(self, positions: torch.Tensor) -> torch.Tensor:
        """The direct formula -> ``[..., rope_dim]``: cos in the first half, sin in the second."""
        freqs = positions[..., None].float() * self.inv_freq
        return torch.cat([freqs.cos() * self.scale, freqs.sin() * self.scale], dim=-1)

    def reserve(self, n_positions: int) -> None:
        """Make the tables cover positions ``[0, n_positions)`` (grown to a power of two)."""
        if n_positions > self.table_size:
            size = max(_MIN_TABLE, 1 << (n_positions - 1).bit_length())
            self._table = self._cos_sin_fp32(torch.arange(size, device=self.inv_freq.device))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width tables ``[..., rope_dim // 2]``, rounded to ``dtype`` like the reference.

        ``max_position``: a bound the caller knows on the host for non-negative integer ``positions``;
        with it the lookup reads nothing back from the device (CUDA-graph friendly).
        """
        half = self.inv_freq.shape[0]
        if positions.numel() == 0:
            table = self._table.new_empty((*positions.shape, 2 * half))
        elif max_position is not None:
            self.reserve(max_position + 1)
            table = self._table[positions]
        else:
            low, high = (int(v) for v in torch.aminmax(positions))
            if low < 0 or positions.is_floating_point():  # not a table index: the direct formula
                table = self._cos_sin_fp32(positions)
            else:
                self.reserve(high + 1)
                table = self._table[positions]
        table = table.to(dtype)
        return table[..., :half], table[..., half:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` in float32.

    ``cos``/``sin`` are ``[T, r/2]``; ``x`` is ``[T, ..., d]`` (any number of head dims). Pair ``(a, b)``
    becomes ``(a*cos - b*sin, b*cos + a*sin)``: the reference's ``x*cos + rotate_half(x)*sin`` with its
    roundings (``a*c + (-b)*s`` and ``a*c - b*s`` are the same float), without widening the tables.
    """
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - cos.dim()) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    pairs = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., : -2 * half], rotated.to(x.dtype)], dim=-1)
