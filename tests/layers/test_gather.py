"""gather_rows: the rows advanced indexing gives, for every index shape the model reads with."""

from __future__ import annotations

import pytest
import torch

from hybridserve.layers.gather import gather_rows


@pytest.mark.parametrize("index_shape", [(0,), (5,), (3, 4), (2, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_gather_rows_equals_advanced_indexing(index_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    source = (torch.randn(11, 3, 4, generator=g) * 50).to(dtype)
    index = torch.randint(0, 11, index_shape, generator=g)
    out = gather_rows(source, index)
    assert out.shape == (*index_shape, 3, 4) and out.dtype == dtype
    assert torch.equal(out, source[index])


def test_gather_rows_of_a_non_contiguous_index() -> None:
    source = torch.arange(40.0).view(10, 4)
    index = torch.tensor([[1, 2, 3], [4, 5, 6]]).t()  # a transposed view
    assert torch.equal(gather_rows(source, index), source[index])
