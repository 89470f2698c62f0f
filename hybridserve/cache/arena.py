"""The page arena: one byte storage whose pages every cache group takes and gives back.

A page belongs to at most one group at a time. A group's page is *active* while one of its blocks is
referenced; when none is, the page goes back to the arena at once, unless it still holds blocks cached
under a prefix hash: then it is *parked* (its cached blocks stay findable) until a prefix hit makes it
active again or a group short of pages reclaims it (least recently parked first, whatever group parked
it), which forgets those cached blocks.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import torch

from hybridserve.cache.arena_plan import ArenaPlan
from hybridserve.cache.flat_rows import FlatRows
from hybridserve.cache.plan import GroupPlan
from hybridserve.cache.pool import BlockPool, zero_runs, zeroed

NULL_PAGE = 0


class SparseTable(dict[int, Any]):
    """A per-block table that stores only entries other than ``default``: an arena group addresses a
    block id for every slot of every page (hundreds of millions for a small group of a large arena),
    and holds few of them."""

    def __init__(self, default: Any) -> None:
        super().__init__()
        self.default = default

    def __missing__(self, block: int) -> Any:
        return self.default

    def __setitem__(self, block: int, value: Any) -> None:
        if value == self.default:
            self.pop(block, None)
        else:
            super().__setitem__(block, value)


class PageArena:
    """The pages and their owners; groups' views of ``storage`` are made by ``ArenaBlockPool``."""

    def __init__(self, plan: ArenaPlan, device: torch.device | str) -> None:
        self.plan = plan
        self.storage = zeroed((plan.total_bytes,), torch.uint8, device)
        self.owner: list[str | None] = [None] * plan.num_pages
        self._free: dict[int, None] = dict.fromkeys(range(plan.num_pages - 1, NULL_PAGE, -1))  # LIFO
        self.pools: dict[str, ArenaBlockPool] = {}
        self.num_reclaimed = 0  # parked pages taken back (their cached blocks forgotten)
        self._ticks = itertools.count()
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The storage as one flat tensor of ``dtype`` (the same tensor on every call)."""
        if dtype not in self._typed:
            self._typed[dtype] = self.storage.view(dtype)
        return self._typed[dtype]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_parked(self) -> int:
        return sum(p.num_parked for p in self.pools.values())

    def acquire(self, group: str) -> int:
        """A page for ``group``: a free one, else the least recently parked page of any group."""
        if not self._free:
            assert self.num_parked, "no free or parked page: the caller did not check can_allocate"
            oldest = min((p for p in self.pools.values() if p.num_parked), key=lambda p: p.oldest_parked)
            oldest.reclaim_oldest()
            self.num_reclaimed += 1
        page, _ = self._free.popitem()
        self._own(page, group)
        return page

    def acquire_page(self, page: int, group: str) -> None:
        """Take back one given page (undoing a release that happened in the same allocation)."""
        del self._free[page]
        self._own(page, group)

    def _own(self, page: int, group: str) -> None:
        assert self.owner[page] is None, f"page {page} already belongs to {self.owner[page]}"
        self.owner[page] = group

    def release(self, page: int) -> None:
        assert page != NULL_PAGE and self.owner[page] is not None
        self.owner[page] = None
        self._free[page] = None

    def tick(self) -> int:
        return next(self._ticks)

    def check_integrity(self) -> None:
        """Every page but the null one is free or held by exactly the group that says it holds it."""
        held = {g: p.held_pages() for g, p in self.pools.items()}
        seen: set[int] = set(self._free)
        assert NULL_PAGE not in seen and self.owner[NULL_PAGE] is None
        assert all(self.owner[p] is None for p in self._free)
        for group, pages in held.items():
            assert not pages & seen, f"{group}: a page also held elsewhere or free"
            assert all(self.owner[p] == group for p in pages)
            seen |= pages
        assert len(seen) == self.plan.usable_pages, "pages leaked: bytes not conserved"


class ArenaBlockPool(BlockPool):
    """One group's blocks, cut from the arena pages it holds (``BlockPool``'s contract otherwise).

    Block b lies in page ``b // blocks_per_page``; blocks of the null page are never handed out. The
    group's tensors are strided views of the arena storage (see ``arena_plan``), so the model reads and
    writes rows by slot exactly as from a fixed pool.
    """

    def __init__(self, plan: GroupPlan, arena: PageArena) -> None:
        assert plan.layout is not None
        self.arena, self.layout = arena, plan.layout
        self.per_page = plan.layout.blocks_per_page
        super().__init__(plan, arena.storage.device)
        self._plain: dict[int, None] = {}  # unreferenced, uncached blocks of active pages (LIFO)
        self._active: dict[int, int] = {}  # page -> referenced blocks in it (> 0)
        self._parked: OrderedDict[int, int] = OrderedDict()  # page -> tick it was parked at
        self._referenced = 0
        arena.pools[self.name] = self

    def _make_tables(self) -> tuple[SparseTable, SparseTable]:
        return SparseTable(0), SparseTable(None)

    def _initial_free(self) -> range:
        return range(0)  # blocks come with the pages this group takes

    def _make_tensors(self, device: torch.device | str) -> dict[tuple[str, str], torch.Tensor]:
        return {
            key: rows.flat.as_strided(rows.shape, (rows.stride, 1), rows.offset)
            for key, rows in self.flat_rows().items()
        }

    def flat_rows(self) -> dict[tuple[str, str], FlatRows]:
        """Every (layer, field)'s rows in the arena's flat tensor of its dtype (what compiled steps take)."""
        rows = self.plan.num_blocks * self.plan.rows_per_block
        fields = {f.name: f for f in self.plan.spec.fields}
        out = {}
        for layer, name, offset in self.layout.offsets:
            f = fields[name]
            size = f.dtype.itemsize
            flat = self.arena.typed(f.dtype)
            out[(layer, name)] = FlatRows(flat, offset // size, self.layout.row_stride // size, rows, f.width)
        return out

    # ---- counts ------------------------------------------------------------------------------------
    @property
    def num_partial_free(self) -> int:
        """Blocks this group can take without a new page: free or evictable ones of its active pages."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_free(self) -> int:
        """Blocks an allocation of this group alone could take (every free or parked page included)."""
        return self.num_partial_free + self.per_page * (self.arena.num_free + self.arena.num_parked)

    @property
    def num_used(self) -> int:
        return self._referenced

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def oldest_parked(self) -> int:
        return next(iter(self._parked.values()))

    @property
    def num_pages(self) -> int:
        """Pages this group holds (active and parked)."""
        return len(self._active) + len(self._parked)

    def held_pages(self) -> set[int]:
        return set(self._active) | set(self._parked)

    def pages_needed(self, n: int) -> int:
        """New pages an allocation of ``n`` blocks takes at least."""
        return max(0, -(-(n - self.num_partial_free) // self.per_page))

    def _blocks_of(self, page: int) -> range:
        return range(page * self.per_page, (page + 1) * self.per_page)

    # ---- taking and giving back ---------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks of this group alone (``BlockPoolSet.allocate`` takes several groups at once)."""
        pages = self.pages_needed(n)
        assert pages <= self.arena.num_free + self.arena.num_parked, f"{self.name}: {n} blocks do not fit"
        return self.allocate_pages(n, pages, max(0, self.arena.num_free - pages))[0]

    def allocate_pages(self, n: int, pages: int, spare: int) -> tuple[list[int], int]:
        """``n`` blocks taking ``pages`` new pages, plus up to ``spare`` more rather than evicting
        cached blocks of its active pages. -> (blocks, spare pages used)."""
        blocks = [self._take_plain() for _ in range(min(n, len(self._plain)))]
        short = n - len(blocks)
        extra = max(0, min(-(-short // self.per_page) - pages, spare))
        for _ in range(pages + extra if short > 0 else 0):
            self._activate(self.arena.acquire(self.name))
            blocks += [self._take_plain() for _ in range(min(n - len(blocks), len(self._plain)))]
        while len(blocks) < n:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self.num_evicted += 1
            blocks.append(self._reference(block))
        self._zero(blocks)
        return blocks, extra

    def _activate(self, page: int) -> None:
        self._active[page] = 0
        self._plain.update(dict.fromkeys(reversed(self._blocks_of(page))))

    def _take_plain(self) -> int:
        block, _ = self._plain.popitem()
        return self._reference(block)

    def _reference(self, block: int) -> int:
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        self._active[block // self.per_page] += 1
        self._referenced += 1
        return block

    def _zero_now(self, blocks: list[int]) -> None:
        zero_runs(self.arena.storage.view(self.plan.num_blocks, self.layout.block_stride), blocks)

    def _unreferenced(self, block: int) -> None:
        self._referenced -= 1
        if self.block_hash[block] is None:
            self._plain[block] = None
        else:
            self._evictable[block] = None
        page = block // self.per_page
        self._active[page] -= 1
        if self._active[page] == 0:
            self._deactivate(page)

    def _deactivate(self, page: int) -> None:
        """A page with no referenced block: parked while it holds cached blocks, else given back."""
        del self._active[page]
        cached = False
        for b in self._blocks_of(page):
            self._plain.pop(b, None)
            if b in self._evictable:
                del self._evictable[b]
                cached = True
        if cached:
            self._parked[page] = self.arena.tick()
        else:
            self.arena.release(page)

    def touch(self, block: int) -> None:
        """Take a reference to a block: a prefix hit, or taking back a block freed by a failed allocation."""
        page = block // self.per_page
        if self.ref_counts[block]:
            self.ref_counts[block] += 1
            return
        if page in self._parked:
            del self._parked[page]
            self._unpark(page)
        elif page not in self._active:
            self.arena.acquire_page(page, self.name)
            self._activate(page)
        if block in self._plain:
            del self._plain[block]
        else:
            del self._evictable[block]
        self._reference(block)

    def _unpark(self, page: int) -> None:
        self._active[page] = 0
        for b in self._blocks_of(page):
            if self.block_hash[b] is None:
                self._plain[b] = None
            else:
                self._evictable[b] = None

    def reclaim_oldest(self) -> list[int]:
        """Give the least recently parked page back to the arena; -> the cached blocks it forgot."""
        page, _ = self._parked.popitem(last=False)
        forgotten = [b for b in self._blocks_of(page) if self.block_hash[b] is not None]
        for b in forgotten:
            self._uncache(b)
        self.num_evicted += len(forgotten)
        self.arena.release(page)
        return forgotten

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._uncache(block)
        self._plain.update(self._evictable)
        self._evictable.clear()
        while self._parked:
            page, _ = self._parked.popitem()
            self.arena.release(page)

    def check_integrity(self) -> None:
        assert not self._free
        referenced = 0
        for page, count in self._active.items():
            refs = [b for b in self._blocks_of(page) if self.ref_counts[b] > 0]
            idle = [b for b in self._blocks_of(page) if b in self._plain or b in self._evictable]
            assert count == len(refs) > 0, f"{self.name}: page {page} counts {count} referenced blocks"
            assert len(refs) + len(idle) == self.per_page, f"{self.name}: page {page} lost a block"
            referenced += count
        for page in self._parked:
            assert all(self.ref_counts[b] == 0 for b in self._blocks_of(page))
            assert any(self.block_hash[b] is not None for b in self._blocks_of(page))
            assert not any(b in self._plain or b in self._evictable for b in self._blocks_of(page))
        assert referenced == self._referenced == len(self.ref_counts)
        assert all(self.ref_counts[b] == 0 for b in itertools.chain(self._plain, self._evictable))
        assert all(self.block_hash[b] is None for b in self._plain)
        assert all(self.block_hash[b] is not None for b in self._evictable)
        for h, b in self._cached.items():
            assert self.block_hash[b] == h and (b // self.per_page) in self.held_pages()
