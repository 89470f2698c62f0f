"""The cache plan: the single authority on cache geometry (block size, rows, blocks, bytes)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridserve.cache.arena_plan import ArenaPlan, GroupLayout, choose_layouts
from hybridserve.cache.spec import CacheGroupSpec, GroupKind

CACHE_LAYOUTS = ("arena", "fixed")


class CachePlanError(ValueError):
    pass


@dataclass(frozen=True)
class GroupPlan:
    spec: CacheGroupSpec
    rows_per_block: int
    num_blocks: int  # including the null block 0
    layout: GroupLayout | None = None  # where its blocks lie in the page arena (None: a fixed pool)

    @property
    def usable_blocks(self) -> int:
        """Blocks it can hand out (in the arena: if every page but the null one were its own)."""
        if self.layout is not None:
            return self.num_blocks - self.layout.blocks_per_page
        return self.num_blocks - 1

    @property
    def block_bytes(self) -> int:
        return self.rows_per_block * self.spec.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class CachePlan:
    block_tokens: int
    groups: tuple[GroupPlan, ...]
    max_num_batched_tokens: int
    arena: ArenaPlan | None = None  # one byte arena for every group (None: each group a fixed pool)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.spec.name == name:
                return g
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        if self.arena is not None:
            return self.arena.total_bytes
        return sum(g.total_bytes for g in self.groups)

    def blocks_for(self, g: GroupPlan, start: int, end: int) -> int:
        """Blocks a request must hold in group ``g`` while computing tokens [start, end)."""
        if end <= 0:
            return 0
        last = (end - 1) // self.block_tokens
        if g.spec.kind is GroupKind.HISTORY:
            return last + 1
        first = max(0, start - g.spec.window_tokens) // self.block_tokens
        return last - first + 1

    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) that fits in the pools when it runs alone."""
        if self.arena is not None:
            return self._arena_max_request_tokens()
        limit = 1 << 62
        chunk = self.max_num_batched_tokens
        for g in self.groups:
            if g.spec.kind is GroupKind.HISTORY:
                limit = min(limit, g.usable_blocks * self.block_tokens)
            elif self.blocks_for(g, 0, chunk + g.spec.window_tokens) > g.usable_blocks:
                limit = 0
        return limit

    def check_usable(self) -> None:
        """Raise CachePlanError when a window group cannot hold one prefill chunk: no request could run."""
        chunk = self.max_num_batched_tokens
        if self.arena is not None:
            return self._check_arena_usable()
        for g in self.groups:
            need = self.blocks_for(g, 0, chunk + g.spec.window_tokens)
            if g.spec.kind is GroupKind.WINDOW and need > g.usable_blocks:
                raise CachePlanError(
                    f"cache group {g.spec.name!r} has {g.usable_blocks} blocks but one prefill chunk of "
                    f"{chunk} tokens with its {g.spec.window_tokens}-token window needs {need}: no request "
                    f"could run (raise --num-blocks / --kv-cache-memory or lower --max-num-batched-tokens)"
                )

    def describe(self, request_tokens: int | None = None) -> str:
        """A table of the groups: bytes per token, blocks, memory, and what fits."""
        layout = "arena" if self.arena is not None else "fixed"
        lines = [f"block_tokens={self.block_tokens}  total={_fmt_bytes(self.total_bytes)}  layout={layout}"]
        lines.append(
            f"{'group':<12}{'kind':<9}{'stride':>7}{'window':>8}{'layers':>7}"
            f"{'B/token':>10}{'rows/blk':>9}{'blocks':>9}{'memory':>11}"
        )
        for g in self.groups:
            s = g.spec
            window = str(s.window_tokens) if s.kind is GroupKind.WINDOW else "-"
            kind = f"{s.kind.value}{'*' if s.draft else ''}"
            lines.append(
                f"{s.name:<12}{kind:<9}{s.stride:>7}{window:>8}{len(s.layers):>7}"
                f"{s.bytes_per_token:>10.1f}{g.rows_per_block:>9}{g.usable_blocks:>9}"
                f"{_fmt_bytes(g.total_bytes) if self.arena is None else 'arena':>11}"
            )
        draft = [g for g in self.groups if g.spec.draft]
        if draft:
            names = ", ".join(g.spec.name for g in draft)
            size = _fmt_bytes(sum(g.total_bytes for g in draft)) if self.arena is None else "arena pages"
            lines.append(f"* draft groups (speculative decoding): {names}, {size}")
        if self.arena is not None:
            lines += self._describe_arena(request_tokens)
        cap = self.max_request_tokens()
        lines.append(f"longest request that fits alone: {cap:,} tokens")
        if request_tokens:
            fit = self.requests_that_fit(request_tokens)
            lines.append(f"requests of {request_tokens:,} tokens that fit at once: {fit}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data (``hybridserve plan --json``): exact bytes and blocks per group."""
        groups = [
            {
                "name": g.spec.name,
                "kind": g.spec.kind.value,
                "draft": g.spec.draft,
                "stride": g.spec.stride,
                "window_tokens": g.spec.window_tokens if g.spec.kind is GroupKind.WINDOW else None,
                "layers": len(g.spec.layers),
                "bytes_per_token": g.spec.bytes_per_token,
                "rows_per_block": g.rows_per_block,
                "blocks": g.usable_blocks,
                "block_bytes": g.block_bytes,
                "bytes": g.total_bytes,
            }
            for g in self.groups
        ]
        return {
            "block_tokens": self.block_tokens,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "total_bytes": self.total_bytes,
            "max_request_tokens": self.max_request_tokens(),
            "groups": groups,
        }

    def requests_that_fit(self, tokens: int) -> int:
        """How many requests of ``tokens`` tokens (decoding at the end) fit at once."""
        if self.arena is not None:
            each = {g.spec.name: self.blocks_for(g, tokens - 1, tokens) for g in self.groups}
            return _most(lambda r: self.pages_for({n: r * b for n, b in each.items()}) <= self.arena_pages)
        fits = 1 << 62
        for g in self.groups:
            need = self.blocks_for(g, tokens - 1, tokens)
            fits = min(fits, g.usable_blocks // max(need, 1))
        return fits

    # ---- the page arena (every group draws whole pages from one byte arena) ----------------------
    @property
    def arena_pages(self) -> int:
        """Pages groups may take (the null page excluded)."""
        assert self.arena is not None
        return self.arena.usable_pages

    def pages_for(self, blocks: dict[str, int]) -> int:
        """Arena pages that hold ``blocks`` blocks per group (a page holds blocks of one group only)."""
        return sum(-(-n // _per_page(self.group(name))) for name, n in blocks.items() if n > 0)

    def _window_peak(self) -> dict[str, int]:
        """Blocks each window group holds while one full prefill chunk runs."""
        chunk = self.max_num_batched_tokens
        return {
            g.spec.name: self.blocks_for(g, 0, chunk + g.spec.window_tokens)
            for g in self.groups
            if g.spec.kind is GroupKind.WINDOW
        }

    def _arena_max_request_tokens(self) -> int:
        window = self._window_peak()
        history = [g.spec.name for g in self.groups if g.spec.kind is GroupKind.HISTORY]
        if self.pages_for(window) > self.arena_pages:
            return 0
        if not history:
            return 1 << 62
        blocks = _most(lambda n: self.pages_for(window | dict.fromkeys(history, n)) <= self.arena_pages)
        return blocks * self.block_tokens

    def _check_arena_usable(self) -> None:
        need = self.pages_for(self._window_peak())
        need += sum(1 for g in self.groups if g.spec.kind is GroupKind.HISTORY)
        if need > self.arena_pages:
            raise CachePlanError(
                f"the cache arena has {self.arena_pages} pages but one prefill chunk of "
                f"{self.max_num_batched_tokens} tokens with every group's window needs {need}: no request "
                f"could run (raise --num-blocks / --kv-cache-memory or lower --max-num-batched-tokens)"
            )

    def _describe_arena(self, request_tokens: int | None) -> list[str]:
        assert self.arena is not None
        a = self.arena
        lines = [
            f"arena: {a.num_pages:,} pages of {_fmt_bytes(a.page_bytes)} ({a.usable_pages:,} usable, page 0 "
            f"null); every group takes whole pages as it needs them ('blocks' = if it had them all)"
        ]
        for g in self.groups:
            k, stride = _per_page(g), a.page_bytes // _per_page(g)
            pad = 1 - g.block_bytes / stride
            line = f"  {g.spec.name:<12}{k:>5} blocks/page  stride {stride:,} B ({pad:.1%} padding)"
            if request_tokens:
                blocks = self.blocks_for(g, request_tokens - 1, request_tokens)
                line += f"  a {request_tokens:,}-token request: {blocks} blocks = {blocks / k:.2f} pages"
            lines.append(line)
        return lines


def build_plan(
    specs: list[CacheGroupSpec],
    block_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    window_cache_share: float = 0.0,
    layout: str = "fixed",
) -> CachePlan:
    """Size every group's pool from a byte budget, or give every group ``num_blocks`` blocks.

    ``layout`` "arena": one byte arena of that budget (or of the bytes ``num_blocks`` blocks of every
    group take) that the groups draw pages from as they need them; ``window_cache_share`` is unused.
    ``layout`` "fixed": with a byte budget, window groups get enough blocks for ``max_num_seqs`` requests
    decoding plus one full prefill budget, and ``window_cache_share`` of the rest so that cached
    prefixes keep the window context a hit needs; history groups share what is left so that each holds
    as many tokens.
    """
    for s in specs:
        if block_tokens % s.stride:
            raise CachePlanError(
                f"block_tokens={block_tokens} is not a multiple of group {s.name!r} stride {s.stride} "
                f"(choose --block-tokens as a multiple of every compress rate)"
            )
    rows = {s.name: block_tokens // s.stride for s in specs}
    if layout == "arena":
        return _arena_plan(specs, rows, block_tokens, max_num_batched_tokens, memory_bytes, num_blocks)
    if layout != "fixed":
        raise CachePlanError(f"cache layout {layout!r}: choose one of {', '.join(CACHE_LAYOUTS)}")
    if num_blocks is not None:
        counts = {s.name: num_blocks + 1 for s in specs}
    elif memory_bytes is not None:
        budget = _Budget(specs, rows, block_tokens, memory_bytes)
        counts = budget.split(max_num_seqs, max_num_batched_tokens, window_cache_share)
    else:
        raise CachePlanError("give either a memory budget or a number of blocks")
    groups = tuple(GroupPlan(s, rows[s.name], counts[s.name]) for s in specs)
    return CachePlan(block_tokens, groups, max_num_batched_tokens)


def _arena_plan(
    specs: list[CacheGroupSpec],
    rows: dict[str, int],
    block_tokens: int,
    max_num_batched_tokens: int,
    memory_bytes: int | None,
    num_blocks: int | None,
) -> CachePlan:
    page, layouts = choose_layouts(specs, rows)
    if num_blocks is not None:
        memory_bytes = page + num_blocks * sum(layouts[s.name].block_stride for s in specs)
        num_pages = -(-memory_bytes // page)
    elif memory_bytes is not None:
        num_pages = memory_bytes // page
    else:
        raise CachePlanError("give either a memory budget or a number of blocks")
    if num_pages < 2:
        raise CachePlanError(
            f"KV cache budget {_fmt_bytes(memory_bytes)} is less than two {_fmt_bytes(page)} pages of the "
            f"cache arena (raise --kv-cache-memory)"
        )
    groups = tuple(
        GroupPlan(s, rows[s.name], num_pages * layouts[s.name].blocks_per_page, layouts[s.name])
        for s in specs
    )
    return CachePlan(block_tokens, groups, max_num_batched_tokens, ArenaPlan(page, num_pages))


def _per_page(g: GroupPlan) -> int:
    assert g.layout is not None, "a fixed pool has no pages"
    return g.layout.blocks_per_page


def _most(fits: Callable[[int], bool]) -> int:
    """The largest n >= 0 with ``fits(n)`` (``fits`` is monotone and ``fits(0)`` holds)."""
    hi = 1
    while fits(hi):
        hi *= 2
        if hi > 1 << 62:
            return hi
    lo = hi // 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class _Budget:
    def __init__(
        self, specs: list[CacheGroupSpec], rows: dict[str, int], block_tokens: int, memory: int
    ) -> None:
        self.block_tokens, self.memory = block_tokens, memory
        self.window = [s for s in specs if s.kind is GroupKind.WINDOW]
        self.history = [s for s in specs if s.kind is GroupKind.HISTORY]
        self.block_bytes = {s.name: rows[s.name] * s.row_bytes for s in specs}

    def _bytes(self, group: list[CacheGroupSpec]) -> int:
        return sum(self.block_bytes[s.name] for s in group)

    def split(self, max_num_seqs: int, max_num_batched_tokens: int, cache_share: float) -> dict[str, int]:
        counts = {}
        for s in self.window:
            per_seq = math.ceil(s.window_tokens / self.block_tokens) + 2
            counts[s.name] = (
                1 + max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / self.block_tokens)
            )
        used = sum(counts[s.name] * self.block_bytes[s.name] for s in self.window)
        left = self.memory - used
        if left < 0 or (self.history and left < 2 * self._bytes(self.history)):
            raise CachePlanError(
                f"KV cache budget {_fmt_bytes(self.memory)} does not cover the {_fmt_bytes(used)} of window "
                f"state for {max_num_seqs} sequences plus history blocks "
                f"(raise --kv-cache-memory or lower --max-num-seqs)"
            )
        share = cache_share if self.history else 1.0
        extra = int(left * share) // max(self._bytes(self.window), 1) if self.window else 0
        counts.update({s.name: counts[s.name] + extra for s in self.window})
        left -= extra * self._bytes(self.window)
        if self.history:
            n = left // self._bytes(self.history)
            counts.update({s.name: int(n) for s in self.history})
        return counts


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
