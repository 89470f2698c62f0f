"""Precomputed rope tables and the pairwise ``apply_rope`` against the direct formulas, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hybridserve.layers.rope import Rotary, apply_rope
from hybridserve.layers.rope_config import RopeConfig

CONFIGS = {
    "default": RopeConfig(theta=10000.0, rope_dim=64),
    "compress": RopeConfig(theta=160000.0, rope_dim=64),
    "bundled": RopeConfig(theta=10000.0, rope_dim=16),
    "yarn": RopeConfig(
        theta=10000.0,
        rope_dim=64,
        rope_type="yarn",
        factor=16.0,
        original_max_position_embeddings=4096,
        attention_factor=1.2079,
    ),
    "yarn_untruncated": RopeConfig(
        theta=160000.0,
        rope_dim=32,
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=2048,
        beta_fast=16.0,
        beta_slow=2.0,
        attention_factor=0.9,
        truncate=False,
    ),
}
N_POSITIONS = 70000


def reference_cos_sin(
    rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    freqs = positions[..., None].float() * rotary.inv_freq
    return (freqs.cos() * rotary.scale).to(dtype), (freqs.sin() * rotary.scale).to(dtype)


def reference_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    def rotate_half(v: torch.Tensor) -> torch.Tensor:
        return torch.stack((-v[..., 1::2], v[..., 0::2]), dim=-1).flatten(-2)

    extra = x.dim() - cos.dim()
    shape = (cos.shape[0],) + (1,) * extra + (cos.shape[-1] * 2,)
    cos = cos.repeat_interleave(2, dim=-1).reshape(shape)
    sin = sin.repeat_interleave(2, dim=-1).reshape(shape)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rotated = (rope.float() * cos + rotate_half(rope).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def _chunks(n: int) -> list[torch.Tensor]:
    """Positions [0, n) in chunks of varied sizes (decode steps, small and large prefills)."""
    sizes, out, start = [1, 1, 7, 64, 3, 4096, 1, 513], [], 0
    i = 0
    while start < n:
        size = min(sizes[i % len(sizes)], n - start)
        out.append(torch.arange(start, start + size))
        start, i = start + size, i + 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_table_lookups_equal_the_formula_up_to_70000(name: str, dtype: torch.dtype) -> None:
    rotary = Rotary(CONFIGS[name], "cpu")
    for positions in _chunks(N_POSITIONS):
        _assert_same(rotary.cos_sin(positions, dtype), reference_cos_sin(rotary, positions, dtype))
    assert rotary.table_size == 131072  # grown by doubling, to a power of two
    everything = torch.arange(N_POSITIONS)
    _assert_same(rotary.cos_sin(everything, dtype), reference_cos_sin(rotary, everything, dtype))


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_any_position_order_and_shape(name: str) -> None:
    rotary = Rotary(CONFIGS[name], "cpu")
    g = torch.Generator().manual_seed(0)
    for shape in [(1,), (37,), (3, 5), (2, 4, 6)]:
        positions = torch.randint(0, 50000, shape, generator=g)
        _assert_same(
            rotary.cos_sin(positions, torch.float32), reference_cos_sin(rotary, positions, torch.float32)
        )
    repeated = torch.tensor([5, 5, 0, 49999, 5])
    _assert_same(
        rotary.cos_sin(repeated, torch.bfloat16), reference_cos_sin(rotary, repeated, torch.bfloat16)
    )


def test_growth_does_not_change_earlier_entries() -> None:
    rotary = Rotary(CONFIGS["yarn"], "cpu")
    positions = torch.arange(0, 1000, 3)
    before = rotary.cos_sin(positions, torch.float32)
    small = rotary.table_size
    rotary.cos_sin(torch.tensor([small * 5]), torch.float32)
    assert rotary.table_size >= small * 5 + 1 and rotary.table_size & (rotary.table_size - 1) == 0
    _assert_same(rotary.cos_sin(positions, torch.float32), before)
    rotary.reserve(10)  # never shrinks
    assert rotary.table_size >= small * 5 + 1


def test_negative_empty_and_integer_dtypes() -> None:
    rotary = Rotary(CONFIGS["default"], "cpu")
    negative = torch.tensor([-3, 0, 7])
    _assert_same(rotary.cos_sin(negative, torch.float32), reference_cos_sin(rotary, negative, torch.float32))
    empty = torch.zeros(0, dtype=torch.long)
    _assert_same(rotary.cos_sin(empty, torch.bfloat16), reference_cos_sin(rotary, empty, torch.bfloat16))
    int32 = torch.arange(10, 20, dtype=torch.int32)
    _assert_same(rotary.cos_sin(int32, torch.float32), reference_cos_sin(rotary, int32, torch.float32))


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (33, 4, 64), (1, 3, 2, 32), (6, 16)])
def test_apply_rope_is_bit_identical(
    shape: tuple[int, ...], x_dtype: torch.dtype, table_dtype: torch.dtype
) -> None:
    rotary = Rotary(CONFIGS["yarn" if shape[-1] == 64 else "bundled"], "cpu")
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).to(x_dtype)
    positions = torch.randint(0, 70000, (shape[0],), generator=g)
    cos, sin = rotary.cos_sin(positions, table_dtype)
    if cos.shape[-1] * 2 > shape[-1]:
        cos, sin = cos[..., : shape[-1] // 4], sin[..., : shape[-1] // 4]
    for s in (sin, -sin):  # the attention output is un-rotated with -sin
        _assert_same((apply_rope(x, cos, s),), (reference_apply_rope(x, cos, s),))
