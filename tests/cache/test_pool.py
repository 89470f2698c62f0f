from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import NULL_BLOCK, block_runs, zeroed
from hybridserve.cache.pool_set import BlockPoolSet
from tests.cache.helpers import toy_specs


def _pools(n: int = 4) -> BlockPoolSet:
    return BlockPoolSet(build_plan(toy_specs(), 8, 2, 16, num_blocks=n), "cpu")


def test_blocks_are_zeroed_when_handed_out_and_null_block_never_is() -> None:
    pools = _pools()
    pool = pools["win"]
    got = pool.allocate(4)
    assert NULL_BLOCK not in got and len(set(got)) == 4
    pool.tensors[("l0", "kv")].fill_(7.0)
    pool.free(got[:1])
    again = pool.allocate(1)
    rows = pool.tensors[("l0", "kv")].view(pool.num_blocks, 8, 2)[again[0]]
    assert torch.all(rows == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_pool_memory_starts_zero_in_tensors_of_their_own(dtype: torch.dtype) -> None:
    """``zeroed``: the kernel's lazily zeroed pages on CPU, in the asked shape and dtype, writable, and no
    two tensors share memory (a write to one pool's rows never shows in another's)."""
    a, b = zeroed((5, 3), dtype, "cpu"), zeroed((5, 3), dtype, "cpu")
    assert a.shape == (5, 3) and a.dtype == dtype and a.is_contiguous()
    assert torch.all(a.float() == 0) and torch.all(b.float() == 0)
    a.view(torch.uint8).fill_(1)
    assert torch.all(b.view(torch.uint8) == 0)
    assert zeroed((0, 3), dtype, "cpu").shape == (0, 3)


def test_a_fixed_pool_starts_all_zero() -> None:
    pools = _pools(64)
    assert all(not t.any() for pool in pools.pools.values() for t in pool.tensors.values())


def test_all_or_nothing_across_groups() -> None:
    pools = _pools(4)
    assert pools.allocate({"win": 3, "rows": 3}) is not None
    before = {n: p.num_free for n, p in pools.pools.items()}
    assert pools.allocate({"win": 1, "rows": 2}) is None
    assert {n: p.num_free for n, p in pools.pools.items()} == before


def test_double_free_is_caught() -> None:
    pool = _pools()["rows"]
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = _pools(3)["rows"]
    a, b, c = pool.allocate(3)
    pool.publish(a, b"hash-a")
    pool.free([a])  # cached: evictable
    pool.free([b])  # plain free
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"hash-a") == a
    assert pool.allocate(1) == [a]  # only now is the cached block evicted
    assert pool.lookup(b"hash-a") is None
    pool.free([a, c])
    pool.check_integrity()


def test_zeroing_batched_zeroes_every_block_handed_out_inside_once_on_leaving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's allocations (one per request) are zeroed together when the scheduler leaves the batch."""
    pools = _pools(8)
    for t in pools.tensors().values():
        t.fill_(7.0)
    zeroed: dict[str, list[list[int]]] = {name: [] for name in pools.pools}
    for name, p in pools.pools.items():
        real = p._zero_now

        def recording(blocks: list[int], name: str = name, real: Callable[[list[int]], None] = real) -> None:
            zeroed[name].append(list(blocks))
            real(blocks)

        monkeypatch.setattr(p, "_zero_now", recording)
    with pools.zeroing_batched():
        first = pools.allocate({"win": 2, "rows": 1})
        second = pools.allocate({"win": 1, "rows": 2})
        assert first is not None and second is not None
        assert not any(zeroed.values())  # nothing zeroed yet
    # one fill per group (one index_fill_ per tensor) holding both allocations' blocks
    assert zeroed == {
        "win": [first["win"] + second["win"]],
        "rows": [first["rows"] + second["rows"]],
        "state": [],
    }
    for name in ("win", "rows"):
        pool = pools[name]
        taken = set(first[name] + second[name])
        for t in pool.tensors.values():
            blocks = t.view(pool.num_blocks, pool.plan.rows_per_block, -1)
            for b in range(pool.num_blocks):
                assert torch.all(blocks[b] == (0.0 if b in taken else 7.0)), (name, b)
    later = pools["win"].allocate(1)  # outside a batch: zeroed at once
    pool = pools["win"]
    assert torch.all(
        pool.tensors[("l0", "kv")].view(pool.num_blocks, pool.plan.rows_per_block, -1)[later[0]] == 0
    )


def test_block_runs_are_the_consecutive_stretches() -> None:
    assert block_runs([]) == []
    assert block_runs([7, 3, 4, 5, 9, 8, 12]) == [(3, 6), (7, 10), (12, 13)]


@pytest.mark.parametrize("layout", ["fixed", "arena"])
def test_zeroing_touches_the_blocks_handed_out_and_no_other(layout: str) -> None:
    pools = BlockPoolSet(build_plan(toy_specs(), 8, 2, 16, num_blocks=12, layout=layout), "cpu")
    pool = pools["win"]
    held = pool.allocate(9)
    for t in pool.tensors.values():
        t.fill_(5.0)
    pool.free([held[1], held[2], held[4], held[7]])
    again = pool.allocate(4)
    assert sorted(again) == sorted([held[1], held[2], held[4], held[7]])
    for t in pool.tensors.values():
        blocks = t.unflatten(0, (pool.num_blocks, pool.plan.rows_per_block))
        for b in range(1, pool.num_blocks):
            if b in again:
                assert torch.all(blocks[b] == 0), b
            elif b in held:
                assert torch.all(blocks[b] == 5.0), b
