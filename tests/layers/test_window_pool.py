"""pool_windows (an HCA compressor's pooling in a compiled CPU decode step) against the compressor's own
path: the same rows when a window completes, the null block's pooling (zero rows) when none does, and the
same through inductor over an arena's flat rows."""

from __future__ import annotations

import torch

from hybridserve.cache.flat_rows import FlatRows
from hybridserve.layers.gather import gather_rows
from hybridserve.layers.rope import apply_rope
from hybridserve.layers.window_pool import pool_windows
from hybridserve.models.deepseek_v4 import Compressor

DIM, RATE, ROPE_HALF, ROWS = 16, 8, 4, 40


def _compressor() -> Compressor:
    comp = Compressor(hidden=12, dim=DIM, rate=RATE, overlap=False, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g))
        comp.norm.weight.copy_(torch.rand(DIM, generator=g) + 0.5)
    return comp


def _inputs(n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n)
    kv, gate = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)
    kv[0], gate[0] = 0, 0  # the null block's row
    src = torch.randint(1, ROWS, (n, RATE), generator=g)
    valid = torch.rand(n, RATE, generator=g) > 0.2
    cos, sin = torch.rand(n, ROPE_HALF, generator=g), torch.rand(n, ROPE_HALF, generator=g)
    return kv, gate, src, valid, cos, sin


def _expected(
    comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, src: torch.Tensor, *rest: torch.Tensor
) -> torch.Tensor:
    valid, cos, sin = rest
    return apply_rope(comp.compress(gather_rows(kv, src), gather_rows(gate, src), valid), cos, sin)


def test_pools_like_the_compressor_when_a_window_completes() -> None:
    comp = _compressor()
    kv, gate, src, valid, cos, sin = _inputs(5)
    got = pool_windows(kv, gate, src, valid, torch.tensor(True), comp.ape, comp.norm.weight, 1e-6, cos, sin)
    assert torch.equal(got, _expected(comp, kv, gate, src, valid, cos, sin))


def test_no_window_completing_gives_the_null_blocks_pooling() -> None:
    """Every entry of such a step is padding: it pools the null block (slot 0, zero rows)."""
    comp = _compressor()
    kv, gate, _, valid, cos, sin = _inputs(3)
    src = torch.zeros(3, RATE, dtype=torch.long)
    got = pool_windows(kv, gate, src, valid, torch.tensor(False), comp.ape, comp.norm.weight, 1e-6, cos, sin)
    assert torch.equal(got, _expected(comp, kv, gate, src, valid, cos, sin))
    assert got.shape == (3, DIM) and not got.any()


def test_compiled_over_flat_rows_equals_eager() -> None:
    """A compiled step hands the op strided views of the arena's one flat tensor (inductor's C++ code)."""
    comp = _compressor()
    kv, gate, src, valid, cos, sin = _inputs(4)
    flat = torch.zeros(2 * ROWS * DIM + 3)
    kv_rows = FlatRows(flat, 3, 2 * DIM, ROWS, DIM)
    gate_rows = FlatRows(flat, 3 + DIM, 2 * DIM, ROWS, DIM)
    kv_rows.put(torch.arange(ROWS), kv)
    gate_rows.put(torch.arange(ROWS), gate)

    def step(flat_in: torch.Tensor, src: torch.Tensor, completes: torch.Tensor) -> torch.Tensor:
        k = FlatRows(flat_in, 3, 2 * DIM, ROWS, DIM).strided()
        g = FlatRows(flat_in, 3 + DIM, 2 * DIM, ROWS, DIM).strided()
        return pool_windows(k, g, src, valid, completes, comp.ape, comp.norm.weight, 1e-6, cos, sin) * 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        expected = _expected(comp, kv, gate, src, valid, cos, sin)
        assert torch.equal(compiled(flat, src, torch.tensor(True)), expected)
        assert not compiled(flat, src, torch.tensor(False)).any()
