"""The page arena: page geometry, pages going back when free, and cached pages reclaimed across groups."""

from __future__ import annotations

import pytest
import torch

from hybridserve.cache.plan import CachePlanError, build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import CacheGroupSpec, GroupKind, RowField
from tests.cache.helpers import toy_specs


def _arena(num_blocks: int = 4) -> BlockPoolSet:
    return BlockPoolSet(build_plan(toy_specs(), 8, 2, 16, num_blocks=num_blocks, layout="arena"), "cpu")


def _odd_specs() -> list[CacheGroupSpec]:
    """FP8-like rows: odd byte widths next to wider dtypes, so the LCM of block bytes is absurd."""
    fp8 = (RowField("kv.e4m3", 48, torch.uint8), RowField("kv.scale", 1, torch.uint8))
    rows = (*fp8, RowField("kv.rope", 16, torch.bfloat16))
    return [
        CacheGroupSpec("win", GroupKind.WINDOW, 1, rows, ("l0", "l1", "l2"), window_tokens=63),
        CacheGroupSpec("state", GroupKind.WINDOW, 1, (RowField("kv", 96, torch.float32),), ("l1",), 7),
        CacheGroupSpec("rows", GroupKind.HISTORY, 4, rows, ("l1",)),
        CacheGroupSpec("hca", GroupKind.HISTORY, 16, rows, ("l2",)),
    ]


def test_page_is_the_lcm_of_block_bytes_when_that_is_small() -> None:
    plan = build_plan(toy_specs(), 8, 2, 16, num_blocks=4, layout="arena")
    assert plan.arena is not None
    blocks = {g.spec.name: g.block_bytes for g in plan.groups}  # 128, 64 and 16 bytes
    assert plan.arena.page_bytes == 128
    for g in plan.groups:
        assert g.layout is not None and g.layout.block_stride == blocks[g.spec.name]  # no padding


def test_odd_rows_get_a_page_every_block_tiles_with_little_padding() -> None:
    specs = _odd_specs()
    plan = build_plan(specs, 16, 4, 64, memory_bytes=4 << 20, layout="arena")
    assert plan.arena is not None
    page = plan.arena.page_bytes
    for g in plan.groups:
        layout = g.layout
        assert layout is not None
        assert layout.blocks_per_page * layout.block_stride == page
        assert layout.row_stride * g.rows_per_block == layout.block_stride
        assert layout.block_stride >= g.block_bytes
        assert g.block_bytes / layout.block_stride > 0.85, f"{g.spec.name}: too much padding"
        dtypes = {f.name: f.dtype for f in g.spec.fields}
        for _, field, offset in layout.offsets:  # every field starts aligned to its dtype
            assert offset % dtypes[field].itemsize == 0 and layout.row_stride % dtypes[field].itemsize == 0
    assert plan.total_bytes <= 4 << 20


def test_group_views_never_overlap_inside_a_page() -> None:
    pools = BlockPoolSet(build_plan(_odd_specs(), 16, 4, 64, num_blocks=8, layout="arena"), "cpu")
    got = pools.allocate({"win": 3, "state": 2, "rows": 5, "hca": 7})
    assert got is not None
    for value, (name, blocks) in enumerate(got.items(), start=1):
        pool = pools[name]
        r = pool.plan.rows_per_block
        for b in blocks:
            for t in pool.tensors.values():
                t[b * r : (b + 1) * r] = value
    for value, (name, blocks) in enumerate(got.items(), start=1):
        pool = pools[name]
        r = pool.plan.rows_per_block
        for b in blocks:
            assert all(torch.all(t[b * r : (b + 1) * r] == value) for t in pool.tensors.values()), name
    pools.check_integrity()


def test_a_page_goes_back_to_the_arena_when_its_blocks_are_free() -> None:
    pools = _arena()
    assert pools.arena is not None
    total = pools.arena.num_free
    got = pools.allocate({"win": 2, "rows": 9})
    assert got is not None and pools.arena.num_free < total
    assert pools.pages_held("rows") == 2  # 9 blocks of 8 per page
    pools["win"].free(got["win"])
    pools["rows"].free(got["rows"])
    assert pools.arena.num_free == total and pools.all_free()
    pools.check_integrity()


def test_one_group_can_take_the_whole_arena_another_left_idle() -> None:
    pools = _arena(num_blocks=4)  # 4 blocks of every group: 4 + 2 + 0.5 pages, and the null page
    rows = pools["rows"]
    assert pools.can_allocate({"rows": 7 * 8}) and not pools.can_allocate({"rows": 7 * 8 + 1})
    got = pools.allocate({"rows": 7 * 8})
    assert got is not None and not pools.can_allocate({"win": 1})
    assert pools.allocate({"win": 1, "state": 1}) is None
    rows.free(got["rows"])
    pools.check_integrity()


def test_all_or_nothing_counts_the_pages_of_every_group_at_once() -> None:
    pools = _arena(num_blocks=4)
    assert pools.arena is not None and pools.arena.num_free == 7
    assert pools.can_allocate({"win": 4, "state": 4, "rows": 4})  # 4 + 2 + 1 pages
    assert not pools.can_allocate({"win": 5, "state": 4, "rows": 4})
    before = (pools.arena.num_free, {n: p.num_free for n, p in pools.pools.items()})
    assert pools.allocate({"win": 5, "state": 4, "rows": 4}) is None
    assert (pools.arena.num_free, {n: p.num_free for n, p in pools.pools.items()}) == before


def test_a_group_short_of_pages_reclaims_another_groups_cached_blocks() -> None:
    pools = _arena(num_blocks=4)
    assert pools.arena is not None
    win, rows = pools["win"], pools["rows"]
    cached = win.allocate(3)
    for i, b in enumerate(cached):
        win.publish(b, f"prefix-{i}".encode())
    win.free(cached)  # unreferenced but cached: the pages are parked, not free
    assert pools.arena.num_parked == 3 and pools.pages_held("win") == 3
    assert win.lookup(b"prefix-0") == cached[0]
    got = pools.allocate({"rows": 7 * 8})  # every page: the free ones, then the parked ones
    assert got is not None
    assert pools.arena.num_reclaimed == 3 and win.num_evicted == 3
    assert win.lookup(b"prefix-0") is None and pools.pages_held("win") == 0
    rows.free(got["rows"])
    assert pools.all_free()
    pools.check_integrity()


def test_a_prefix_hit_revives_a_parked_page_and_free_pages_are_taken_before_parked_ones() -> None:
    pools = _arena(num_blocks=4)
    assert pools.arena is not None
    win = pools["win"]
    (b,) = win.allocate(1)
    win.publish(b, b"prefix")
    win.free([b])
    assert pools.allocate({"rows": 8 * 6}) is not None  # the six free pages
    assert pools.arena.num_reclaimed == 0 and win.lookup(b"prefix") == b
    win.touch(b)
    assert pools.arena.num_parked == 0 and win.num_used == 1
    pools.check_integrity()


def test_reset_prefix_cache_gives_parked_pages_back() -> None:
    pools = _arena()
    assert pools.arena is not None
    total = pools.arena.num_free
    win = pools["win"]
    blocks = win.allocate(2)
    win.publish(blocks[0], b"a")
    win.free(blocks)
    assert pools.arena.num_free == total - 1
    win.reset_prefix_cache()
    assert pools.arena.num_free == total and win.num_cached == 0
    pools.check_integrity()


def test_arena_plan_capacity_and_errors() -> None:
    fixed = build_plan(toy_specs(window=5), 8, 4, 64, memory_bytes=1 << 16)
    arena = build_plan(toy_specs(window=5), 8, 4, 64, memory_bytes=1 << 16, layout="arena")
    assert arena.total_bytes <= 1 << 16
    assert arena.max_request_tokens() > fixed.max_request_tokens()  # history may take the window's share
    assert arena.requests_that_fit(200) >= fixed.requests_that_fit(200)
    text = arena.describe(request_tokens=200)
    assert "layout=arena" in text and "blocks/page" in text and "pages of 128 B" in text
    with pytest.raises(CachePlanError, match="raise --kv-cache-memory"):
        build_plan(toy_specs(), 8, 4, 64, memory_bytes=200, layout="arena")
    with pytest.raises(CachePlanError, match=r"arena has \d+ pages .*--max-num-batched-tokens"):
        build_plan(toy_specs(window=5), 8, 4, 512, num_blocks=2, layout="arena").check_usable()
    with pytest.raises(CachePlanError, match="cache layout 'paged'"):
        build_plan(toy_specs(), 8, 4, 64, num_blocks=2, layout="paged")


def test_a_large_arena_keeps_per_block_tables_sparse() -> None:
    """A small group of a 64 GiB arena addresses ~10^8 block ids; its tables hold only the blocks in use."""
    plan = build_plan(_odd_specs(), 16, 256, 8192, memory_bytes=64 << 30, layout="arena")
    pools = BlockPoolSet(plan, "meta")
    hca = pools["hca"]
    assert hca.num_blocks > 10**7 and len(hca.ref_counts) == 0
    got = pools.allocate({"hca": 3, "rows": 2})
    assert got is not None and len(hca.ref_counts) == 3
    hca.publish(got["hca"][0], b"h")
    hca.free(got["hca"])
    pools["rows"].free(got["rows"])
    assert len(hca.ref_counts) == 0 and len(hca.block_hash) == 1
    hca.reset_prefix_cache()
    assert len(hca.block_hash) == 0 and pools.all_free()
