"""Block pools: the tensors of each cache group, their free lists and reference counts."""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict, deque

import torch

from hybridserve.cache.plan import GroupPlan

NULL_BLOCK = 0


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``blocks`` as runs of consecutive numbers, ``[start, end)`` each (a new page's blocks are one)."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On CPU an anonymous mapping, whose pages the kernel zeroes when first touched:
    writing a cache's zeros up front costs seconds of every start-up (a page fault per 4 KiB page; ~0.6
    s per GiB here, ~8 s for memory the machine had not touched yet), spent instead by the first
    requests that use each page. Blocks are zeroed again when handed out, so either start is the same."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def zero_runs(rows: torch.Tensor, blocks: list[int], rows_per_block: int = 1) -> None:
    """Zero the rows of ``blocks`` in ``rows`` (dim 0: ``rows_per_block`` rows a block), a slice per run
    of consecutive blocks. A fill of each slice is a memset; ``index_fill_`` over a byte view wrote
    element by element (eight 48 KiB blocks: ~800 us against ~26 us, one CPU thread)."""
    for start, end in block_runs(blocks):
        rows[start * rows_per_block : end * rows_per_block].zero_()


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
            (layer, f.name): zeroed((rows, f.width), f.dtype, device)
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
        for t in self.tensors.values():
            zero_runs(t, blocks, r)

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
