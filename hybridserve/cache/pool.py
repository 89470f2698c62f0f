"""Block pools: the tensors of each cache group, their free lists and reference counts."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from hybridserve.cache.plan import CachePlan, GroupPlan

if TYPE_CHECKING:
    from hybridserve.cache.arena import ArenaBlockPool

NULL_BLOCK = 0


class BlockPool:
    """The memory of one cache group, cut into blocks of ``rows_per_block`` rows.

    Block 0 is the null block: never handed out, read where a table has no block. A block with
    refcount 0 is either plain free (reused first) or cached under a prefix hash (evictable, least
    recently used first), so churn of uncached blocks never flushes cached ones.
    """

    def __init__(self, plan: GroupPlan, device: torch.device | str) -> None:
        self.plan = plan
        self.name = plan.spec.name
        self.tensors = self._make_tensors(device)
        self.ref_counts: list[int] | dict[int, int]
        self.block_hash: list[bytes | None] | dict[int, bytes | None]
        self.ref_counts, self.block_hash = self._make_tables()
        self._free: deque[int] = deque(self._initial_free())
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self.num_evicted = 0  # cached blocks handed out again (their prefix forgotten)
        self._deferred: list[int] | None = None  # blocks to zero at once (BlockPoolSet.zeroing_batched)

    def _make_tensors(self, device: torch.device | str) -> dict[tuple[str, str], torch.Tensor]:
        rows = self.plan.num_blocks * self.plan.rows_per_block
        return {
            (layer, f.name): torch.zeros(rows, f.width, dtype=f.dtype, device=device)
            for layer in self.plan.spec.layers
            for f in self.plan.spec.fields
        }

    def _make_tables(self) -> tuple[list[int] | dict[int, int], list[bytes | None] | dict[int, bytes | None]]:
        """Each block's reference count and prefix hash."""
        return [0] * self.plan.num_blocks, [None] * self.plan.num_blocks

    def _initial_free(self) -> range:
        return range(1, self.plan.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.plan.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take (plain free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.plan.usable_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free, f"{self.name}: {n} blocks asked, {self.num_free} free"
        blocks = [self._take() for _ in range(n)]
        self._zero(blocks)
        return blocks

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self.num_evicted += 1
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def defer_zeroing(self) -> None:
        self._deferred = []

    def flush_zeroing(self) -> None:
        blocks, self._deferred = self._deferred or [], None
        self._zero(blocks)

    def _zero(self, blocks: list[int]) -> None:
        if self._deferred is not None:
            self._deferred += blocks
        elif blocks:
            self._zero_now(blocks)

    def _zero_now(self, blocks: list[int]) -> None:
        r = self.plan.rows_per_block
        idx = torch.tensor(blocks, dtype=torch.long)
        rows = (idx[:, None] * r + torch.arange(r)).flatten()
        on_device: dict[torch.device, torch.Tensor] = {}  # one transfer per device, not per tensor
        for t in self.tensors.values():
            if t.device not in on_device:
                on_device[t.device] = rows.to(t.device)
            t.index_fill_(0, on_device[t.device], 0)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced blocks become reusable."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            assert self.ref_counts[block] > 0, f"{self.name}: double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._unreferenced(block)

    def _unreferenced(self, block: int) -> None:
        if self.block_hash[block] is None:
            self._free.appendleft(block)
        else:
            self._evictable[block] = None

    def touch(self, block: int) -> None:
        """Take a reference to a block: a cached one (a prefix hit), or one a failed allocation freed."""
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is None:
                self._free.remove(block)
            else:
                del self._evictable[block]
        self.ref_counts[block] += 1

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def publish(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable under its prefix hash (first writer wins)."""
        assert self.ref_counts[block] > 0
        if self.block_hash[block] is not None or block_hash in self._cached:
            return
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; evictable blocks become plain free."""
        for block in list(self._evictable):
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
        for block in range(1, self.num_blocks):
            self._uncache(block)

    def check_integrity(self) -> None:
        free = list(self._free) + list(self._evictable)
        assert len(free) == len(set(free)), f"{self.name}: a block is free twice"
        assert all(self.ref_counts[b] == 0 for b in free), f"{self.name}: a free block is referenced"
        assert all(c >= 0 for c in self.ref_counts)
        assert NULL_BLOCK not in free and self.ref_counts[NULL_BLOCK] == 0
        referenced = sum(1 for b in range(1, self.num_blocks) if self.ref_counts[b] > 0)
        assert referenced + len(free) == self.plan.usable_blocks, f"{self.name}: blocks leaked"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h


class BlockPoolSet:
    """One pool per cache group; allocations across groups are all-or-nothing.

    With an arena plan the groups' pools draw pages from one ``PageArena`` (``self.arena``), so whether
    counts fit is a question about all groups at once: the new pages they need against the free and
    parked pages.
    """

    def __init__(self, plan: CachePlan, device: torch.device | str) -> None:
        from hybridserve.cache.arena import ArenaBlockPool, PageArena

        self.plan = plan
        self.arena = PageArena(plan.arena, device) if plan.arena is not None else None
        arena = self.arena
        self.pools: dict[str, BlockPool] = {
            g.spec.name: BlockPool(g, device) if arena is None else ArenaBlockPool(g, arena)
            for g in plan.groups
        }

    def __getitem__(self, name: str) -> BlockPool:
        return self.pools[name]

    def can_allocate(self, counts: dict[str, int]) -> bool:
        """Whether ``counts`` blocks per group (negative counts as none) can be taken at once."""
        if self.arena is None:
            return all(self.pools[name].num_free >= n for name, n in counts.items())
        return self._pages_needed(counts) <= self.arena.num_free + self.arena.num_parked

    def _pages_needed(self, counts: dict[str, int]) -> int:
        return sum(self._arena_pool(name).pages_needed(n) for name, n in counts.items())

    def pages_held(self, name: str) -> int:
        """Arena pages group ``name`` holds (0 without an arena)."""
        return 0 if self.arena is None else self._arena_pool(name).num_pages

    def _arena_pool(self, name: str) -> ArenaBlockPool:
        from hybridserve.cache.arena import ArenaBlockPool

        pool = self.pools[name]
        assert isinstance(pool, ArenaBlockPool)
        return pool

    def allocate(
        self, counts: dict[str, int], release: dict[str, list[int]] | None = None
    ) -> dict[str, list[int]] | None:
        """Free ``release`` (one reference per block), then take ``counts`` blocks per group, or change
        nothing and return None when they do not fit even with what ``release`` frees."""
        release = release or {}
        for name, blocks in release.items():
            self.pools[name].free(blocks)
        if not self.can_allocate(counts):
            for name, blocks in release.items():
                for b in blocks:
                    self.pools[name].touch(b)
            return None
        if self.arena is None:
            return {name: self.pools[name].allocate(max(0, n)) for name, n in counts.items()}
        spare = max(0, self.arena.num_free - self._pages_needed(counts))
        out = {}
        for name, n in counts.items():
            pool = self._arena_pool(name)
            out[name], used = pool.allocate_pages(max(0, n), pool.pages_needed(n), spare)
            spare -= used
        return out

    @contextmanager
    def zeroing_batched(self) -> Iterator[None]:
        """Zero the blocks handed out inside together on leaving: one fill per tensor, not one per request
        (a decode step's requests cross block boundaries together). Nothing may touch them before."""
        for pool in self.pools.values():
            pool.defer_zeroing()
        try:
            yield
        finally:
            for pool in self.pools.values():
                pool.flush_zeroing()

    def tensors(self) -> dict[tuple[str, str, str], torch.Tensor]:
        """Every cache tensor, keyed by (group, layer, field)."""
        return {(name, layer, f): t for name, p in self.pools.items() for (layer, f), t in p.tensors.items()}

    def null_rows(self) -> list[torch.Tensor]:
        """The null block's rows of every cache tensor (views): a padded step's writes land there, and
        ``torch._foreach_zero_`` of these restores the invariant that the null block is all zeros."""
        return [
            t[NULL_BLOCK * p.plan.rows_per_block : (NULL_BLOCK + 1) * p.plan.rows_per_block]
            for p in self.pools.values()
            for t in p.tensors.values()
        ]

    def all_free(self) -> bool:
        return all(p.num_used == 0 for p in self.pools.values())

    def check_integrity(self) -> None:
        for p in self.pools.values():
            p.check_integrity()
        if self.arena is not None:
            self.arena.check_integrity()
