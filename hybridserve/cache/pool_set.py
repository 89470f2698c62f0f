"""BlockPoolSet: one block pool per cache group, allocating across groups all or nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridserve.cache.arena import ArenaBlockPool, PageArena
from hybridserve.cache.flat_rows import FlatRows
from hybridserve.cache.plan import CachePlan
from hybridserve.cache.pool import NULL_BLOCK, BlockPool


class BlockPoolSet:
    """One pool per cache group; allocations across groups are all-or-nothing.

    With an arena plan the groups' pools draw pages from one ``PageArena`` (``self.arena``), so whether
    counts fit is a question about all groups at once: the new pages they need against the free and
    parked pages.
    """

    def __init__(self, plan: CachePlan, device: torch.device | str) -> None:
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

    def graph_tensors(self) -> dict[tuple[str, str, str], torch.Tensor | FlatRows]:
        """The cache as compiled steps take it: ``tensors()``, except that an arena's fields come as
        ``FlatRows`` of its one flat tensor (its strided views would be aliased graph inputs)."""
        if self.arena is None:
            return dict(self.tensors())
        dtypes = {f.dtype for g in self.plan.groups for f in g.spec.fields}
        if len(dtypes) > 1:
            raise ValueError(
                "compiled steps over an arena need one cache dtype (an FP8 cache keeps two): "
                "use --cache-layout fixed"
            )
        return {
            (name, layer, f): rows
            for name, p in self.pools.items()
            for (layer, f), rows in self._arena_pool(name).flat_rows().items()
        }

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
