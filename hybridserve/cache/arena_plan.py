"""Geometry of the page arena: one page size for every cache group, and where each group's rows lie.

Every group views the same byte storage. Group g's block b is the ``block_stride`` bytes at offset
``b * block_stride``, so it lies in page ``b // blocks_per_page``, and row ``slot`` of a field is at a
fixed stride: the model's gathers and writes by slot stay one strided tensor op. A page therefore holds
a whole number of each group's blocks: ``page_bytes == blocks_per_page * block_stride``.

Page size choice: the least common multiple of the groups' block bytes wastes nothing, but it is absurd
when block sizes share few factors (an FP8 cache's odd row widths give LCMs of hundreds of MiB). So the
page is searched among multiples of the groups' row alignment between the largest block and
``MAX_PAGE_RATIO`` times it (at most ``MAX_CANDIDATES`` of them, evenly spaced); each group pads its
block stride up to ``page_bytes / blocks_per_page``, and the page whose worst group pads least wins (a
history group may hold most of the memory on long prompts, so no group's padding is discounted; ties go
to the least padding weighted by bytes per token, then the smaller page). The LCM is taken whenever it
is within ``MAX_LCM_RATIO`` times the largest block (no padding at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridserve.cache.spec import CacheGroupSpec

MAX_PAGE_RATIO = 4  # a page holds at most this many blocks of the largest group
MAX_LCM_RATIO = 8  # ...or this many when that makes the page the exact LCM (no padding)
MAX_CANDIDATES = 8192


@dataclass(frozen=True)
class GroupLayout:
    """How one group's blocks and rows lie in the arena's pages."""

    blocks_per_page: int
    block_stride: int  # bytes from one block to the next (its rows plus padding)
    row_stride: int  # bytes from one row to the next
    offsets: tuple[tuple[str, str, int], ...]  # (layer, field, byte offset in a row)


@dataclass(frozen=True)
class ArenaPlan:
    page_bytes: int
    num_pages: int  # including the null page 0 (every group's null block lies in it)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def row_offsets(spec: CacheGroupSpec) -> tuple[tuple[tuple[str, str, int], ...], int, int]:
    """Each (layer, field)'s byte offset in a row, the row's aligned bytes and its alignment.

    Wider element types come first so every field starts aligned to its own dtype.
    """
    pieces = sorted(
        ((layer, f.name, f.dtype.itemsize, f.nbytes) for layer in spec.layers for f in spec.fields),
        key=lambda p: -p[2],
    )
    align = max(p[2] for p in pieces)
    offsets, at = [], 0
    for layer, name, _, nbytes in pieces:
        offsets.append((layer, name, at))
        at += nbytes
    return tuple(offsets), -(-at // align) * align, align


def choose_layouts(specs: list[CacheGroupSpec], rows: dict[str, int]) -> tuple[int, dict[str, GroupLayout]]:
    """The page size and every group's layout (see the module docstring for the choice)."""
    geo = {s.name: row_offsets(s) for s in specs}
    units = {s.name: rows[s.name] * geo[s.name][2] for s in specs}  # a block stride's granule
    least = {s.name: rows[s.name] * geo[s.name][1] for s in specs}  # smallest aligned block
    weight = {s.name: s.bytes_per_token for s in specs}
    unit, largest = math.lcm(*units.values()), max(least.values())
    lo, hi = -(-largest // unit), -(-MAX_PAGE_RATIO * largest // unit)
    candidates = set(range(lo, hi + 1, max(1, (hi - lo) // MAX_CANDIDATES)))
    exact = math.lcm(*least.values())
    if exact <= MAX_LCM_RATIO * largest:
        candidates.add(exact // unit)
    data = {s.name: s.row_bytes * rows[s.name] for s in specs}  # a block's bytes without padding
    best: tuple[float, float, int] = (1.0, 1.0, 0)
    for n in sorted(candidates):
        page = n * unit
        waste: dict[str, float] = {}
        for name in least:  # a page whose worst group pads more than the best page's is dropped early
            floor = math.ceil((1 - best[0]) * page / data[name] - 1e-9)
            k = _blocks_per_page(page, least[name], units[name], floor)
            if not k:
                break
            waste[name] = 1 - k * data[name] / page
        if len(waste) == len(least):
            mean = sum(weight[g] * w for g, w in waste.items())
            best = min(best, (round(max(waste.values()), 9), round(mean, 9), page))
    page = best[2]
    assert page, "a page of the largest block always fits"
    layouts = {}
    for s in specs:
        k = _blocks_per_page(page, least[s.name], units[s.name])
        assert k, "a page always holds one block"
        offsets = geo[s.name][0]
        layouts[s.name] = GroupLayout(k, page // k, page // k // rows[s.name], offsets)
    return page, layouts


def _blocks_per_page(page: int, block: int, unit: int, floor: int = 1) -> int:
    """Most blocks of at least ``block`` bytes, each a multiple of ``unit``, that tile ``page`` exactly;
    0 if that is fewer than ``floor``."""
    granules = page // unit
    for k in range(page // block, max(floor, 1) - 1, -1):
        if granules % k == 0:
            return k
    return 0
