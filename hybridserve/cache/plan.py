"""The cache plan: the single authority on cache geometry (block size, rows, blocks, bytes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridserve.cache.spec import CacheGroupSpec, GroupKind


class CachePlanError(ValueError):
    pass


@dataclass(frozen=True)
class GroupPlan:
    spec: CacheGroupSpec
    rows_per_block: int
    num_blocks: int  # including the null block 0

    @property
    def usable_blocks(self) -> int:
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

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.spec.name == name:
                return g
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
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
        limit = 1 << 62
        chunk = self.max_num_batched_tokens
        for g in self.groups:
            if g.spec.kind is GroupKind.HISTORY:
                limit = min(limit, g.usable_blocks * self.block_tokens)
            elif self.blocks_for(g, 0, chunk + g.spec.window_tokens) > g.usable_blocks:
                limit = 0
        return limit

    def describe(self, request_tokens: int | None = None) -> str:
        """A table of the groups: bytes per token, blocks, memory, and what fits."""
        lines = [f"block_tokens={self.block_tokens}  total={_fmt_bytes(self.total_bytes)}"]
        lines.append(
            f"{'group':<12}{'kind':<9}{'stride':>7}{'window':>8}{'layers':>7}"
            f"{'B/token':>10}{'rows/blk':>9}{'blocks':>9}{'memory':>11}"
        )
        for g in self.groups:
            s = g.spec
            window = str(s.window_tokens) if s.kind is GroupKind.WINDOW else "-"
            lines.append(
                f"{s.name:<12}{s.kind.value:<9}{s.stride:>7}{window:>8}{len(s.layers):>7}"
                f"{s.bytes_per_token:>10.1f}{g.rows_per_block:>9}{g.usable_blocks:>9}"
                f"{_fmt_bytes(g.total_bytes):>11}"
            )
        cap = self.max_request_tokens()
        lines.append(f"longest request that fits alone: {cap:,} tokens")
        if request_tokens:
            fit = self.requests_that_fit(request_tokens)
            lines.append(f"requests of {request_tokens:,} tokens that fit at once: {fit}")
        return "\n".join(lines)

    def requests_that_fit(self, tokens: int) -> int:
        """How many requests of ``tokens`` tokens (decoding at the end) fit at once."""
        fits = 1 << 62
        for g in self.groups:
            need = self.blocks_for(g, tokens - 1, tokens)
            fits = min(fits, g.usable_blocks // max(need, 1))
        return fits


def build_plan(
    specs: list[CacheGroupSpec],
    block_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
) -> CachePlan:
    """Size every group's pool from a byte budget, or give every group ``num_blocks`` blocks.

    With a byte budget, window groups get enough blocks for ``max_num_seqs`` requests decoding plus
    one full prefill budget; the rest of the memory goes to history groups so that each of them holds
    the same number of tokens.
    """
    for s in specs:
        if block_tokens % s.stride:
            raise CachePlanError(
                f"block_tokens={block_tokens} is not a multiple of group {s.name!r} stride {s.stride} "
                f"(choose --block-tokens as a multiple of every compress rate)"
            )
    rows = {s.name: block_tokens // s.stride for s in specs}
    if num_blocks is not None:
        counts = {s.name: num_blocks + 1 for s in specs}
    elif memory_bytes is not None:
        counts = _blocks_from_budget(
            specs, rows, block_tokens, max_num_seqs, max_num_batched_tokens, memory_bytes
        )
    else:
        raise CachePlanError("give either a memory budget or a number of blocks")
    groups = tuple(GroupPlan(s, rows[s.name], counts[s.name]) for s in specs)
    return CachePlan(block_tokens, groups, max_num_batched_tokens)


def _blocks_from_budget(
    specs: list[CacheGroupSpec],
    rows: dict[str, int],
    block_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    memory_bytes: int,
) -> dict[str, int]:
    counts: dict[str, int] = {}
    used = 0
    for s in specs:
        if s.kind is GroupKind.WINDOW:
            per_seq = math.ceil(s.window_tokens / block_tokens) + 2
            counts[s.name] = 1 + max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / block_tokens)
            used += counts[s.name] * rows[s.name] * s.row_bytes
    history = [s for s in specs if s.kind is GroupKind.HISTORY]
    left = memory_bytes - used
    if history:
        per_block = sum(rows[s.name] * s.row_bytes for s in history)
        n = left // per_block
        if n < 2:
            raise CachePlanError(
                f"KV cache budget {_fmt_bytes(memory_bytes)} leaves no room for history blocks after "
                f"{_fmt_bytes(used)} of window state for {max_num_seqs} sequences "
                f"(raise --kv-cache-memory or lower --max-num-seqs)"
            )
        counts.update({s.name: int(n) for s in history})
    elif left > 0:
        scale = memory_bytes / max(used, 1)
        counts = {k: int(v * scale) for k, v in counts.items()}
    elif left < 0:
        raise CachePlanError(
            f"KV cache budget {_fmt_bytes(memory_bytes)} is below the {_fmt_bytes(used)} of window state "
            f"needed for {max_num_seqs} sequences (raise --kv-cache-memory or lower --max-num-seqs)"
        )
    return counts


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
