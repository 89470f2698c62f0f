"""FlatRows: an arena's rows addressed in its one flat tensor (what compiled steps take) are the rows of
its strided views, and the arena reaches a compiled graph as one tensor, not as aliased views."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridserve.cache.flat_rows import FlatRows
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import RowField
from hybridserve.layers.gather import gather_rows, put_rows
from tests.cache.helpers import toy_specs


def _arena() -> BlockPoolSet:
    return BlockPoolSet(build_plan(toy_specs(), 8, 2, 16, num_blocks=6, layout="arena"), "cpu")


def test_graph_tensors_of_an_arena_share_one_flat_tensor() -> None:
    pools = _arena()
    graph = pools.graph_tensors()
    assert graph.keys() == pools.tensors().keys()
    assert all(isinstance(rows, FlatRows) for rows in graph.values())
    flats = {id(rows.flat) for rows in graph.values() if isinstance(rows, FlatRows)}
    assert len(flats) == 1 and next(iter(graph.values())).flat.dim() == 1  # type: ignore[union-attr]
    fixed = BlockPoolSet(build_plan(toy_specs(), 8, 2, 16, num_blocks=6, layout="fixed"), "cpu")
    assert all(isinstance(t, torch.Tensor) for t in fixed.graph_tensors().values())


def test_flat_rows_read_and_write_the_views_rows() -> None:
    pools = _arena()
    got = pools.allocate({name: 2 for name in pools.pools})
    assert got is not None
    views, graph = pools.tensors(), pools.graph_tensors()
    g = torch.Generator().manual_seed(0)
    for key, view in views.items():
        rows = graph[key]
        assert rows.shape == tuple(view.shape) and rows.dtype == view.dtype
        slots = torch.randperm(view.shape[0], generator=g)[:5]
        values = torch.randn(5, view.shape[1], generator=g).to(view.dtype)
        put_rows(rows, slots, values)
        assert torch.equal(view[slots], values)  # written through the flat tensor, seen in the view
        index = torch.randint(0, view.shape[0], (3, 4), generator=g)
        assert torch.equal(gather_rows(rows, index), view[index])
    pools.check_integrity()


def test_an_arena_of_two_dtypes_is_refused_for_compiled_steps() -> None:
    specs = toy_specs()
    mixed = [specs[0], dataclasses.replace(specs[1], fields=(RowField("u", 4, torch.uint8),))]
    pools = BlockPoolSet(build_plan(mixed, 8, 2, 16, num_blocks=6, layout="arena"), "cpu")
    with pytest.raises(ValueError, match="one cache dtype"):
        pools.graph_tensors()
