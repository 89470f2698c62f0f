"""One request's cache blocks, every group, as one buffer sent point-to-point with torch.distributed.

What moves is decided by the plan alone, so both sides agree without asking: after a prefill of
``num_tokens`` tokens, the next token to compute is at position ``num_tokens``; history groups move
every block up to it, window groups only the blocks that token can still see (window KV and the
compressor-state rows). The block that position starts, if it starts one, is empty and stays home.
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridserve.cache.plan import CachePlan
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import GroupKind
from hybridserve.kv_transfer.transfer_group import PairGroup


def handoff_blocks(plan: CachePlan, num_tokens: int) -> dict[str, range]:
    """Per group, the logical blocks that hold what decoding from ``num_tokens`` reads."""
    assert num_tokens >= 1
    last = (num_tokens - 1) // plan.block_tokens
    out = {}
    for g in plan.groups:
        first = 0
        if g.spec.kind is GroupKind.WINDOW:
            first = max(0, num_tokens - g.spec.window_tokens) // plan.block_tokens
        out[g.spec.name] = range(first, last + 1)
    return out


def handoff_bytes(plan: CachePlan, num_tokens: int) -> dict[str, int]:
    """Bytes each group contributes to the handoff of a request of ``num_tokens`` computed tokens."""
    blocks = handoff_blocks(plan, num_tokens)
    return {g.spec.name: len(blocks[g.spec.name]) * g.block_bytes for g in plan.groups}


def _rows(pools: BlockPoolSet, name: str, table: list[int], blocks: range) -> torch.Tensor:
    ids = [table[j] for j in blocks]
    assert NULL_BLOCK not in ids, f"{name}: a block the handoff moves is missing"
    r = pools[name].plan.rows_per_block
    idx = torch.tensor(ids, dtype=torch.long)
    return (idx[:, None] * r + torch.arange(r)).flatten()


def pack(pools: BlockPoolSet, tables: dict[str, list[int]], num_tokens: int) -> torch.Tensor:
    """Copy the moved blocks of every group, field and layer into one flat uint8 buffer."""
    parts = []
    for name, blocks in handoff_blocks(pools.plan, num_tokens).items():
        rows = _rows(pools, name, tables[name], blocks)
        for t in pools[name].tensors.values():
            parts.append(t.index_select(0, rows.to(t.device)).contiguous().view(torch.uint8).flatten())
    return torch.cat(parts)


def unpack(pools: BlockPoolSet, tables: dict[str, list[int]], num_tokens: int, buffer: torch.Tensor) -> None:
    """Write a buffer made by ``pack`` into this side's blocks (the inverse of ``pack``)."""
    offset = 0
    for name, blocks in handoff_blocks(pools.plan, num_tokens).items():
        rows = _rows(pools, name, tables[name], blocks)
        for t in pools[name].tensors.values():
            n = rows.numel() * t.shape[1] * t.dtype.itemsize
            raw = buffer[offset : offset + n]
            if offset % t.dtype.itemsize:  # after odd-width FP8 rows: a wider dtype needs aligned bytes
                raw = raw.clone()
            part = raw.view(t.dtype).view(rows.numel(), t.shape[1])
            t.index_copy_(0, rows.to(t.device), part.to(t.device))
            offset += n
    assert offset == buffer.numel(), "the handoff buffer does not match the plan"


def checksums(plan: CachePlan, num_tokens: int, buffer: torch.Tensor) -> dict[str, int]:
    """CRC-32 of each group's part of a buffer made by ``pack`` (on a GPU: after a copy to the host)."""
    data = buffer.cpu().numpy().data  # a memoryview: slices copy nothing
    out, offset = {}, 0
    for name, n in handoff_bytes(plan, num_tokens).items():
        out[name] = zlib.crc32(data[offset : offset + n])
        offset += n
    return out


def corrupt_groups(plan: CachePlan, num_tokens: int, buffer: torch.Tensor, sent: dict[str, int]) -> list[str]:
    """The groups whose received part does not match the sender's checksum."""
    return [g for g, crc in checksums(plan, num_tokens, buffer).items() if sent.get(g) != crc]


def buffer_size(plan: CachePlan, num_tokens: int) -> int:
    return sum(handoff_bytes(plan, num_tokens).values())


# gloo's point-to-point work completes only inside wait(), which releases the GIL: waiting happens on
# these threads so that the engine loop only polls.
_WAITERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-handoff")


@dataclass
class Transfer:
    """One posted send or receive: poll ``done()``, then ``result()`` raises if it failed."""

    work: dist.Work
    buffer: torch.Tensor
    waited: Future[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.waited = _WAITERS.submit(self.work.wait)

    def done(self) -> bool:
        return self.waited.done()

    def result(self) -> torch.Tensor:
        self.waited.result()
        return self.buffer


def post_send(group: PairGroup, buffer: torch.Tensor, peer: int, tag: int) -> Transfer:
    return Transfer(group.send([buffer], peer, tag), buffer)


def post_recv(
    group: PairGroup, plan: CachePlan, num_tokens: int, peer: int, tag: int, device: torch.device
) -> Transfer:
    buffer = torch.empty(buffer_size(plan, num_tokens), dtype=torch.uint8, device=device)
    return Transfer(group.recv([buffer], peer, tag), buffer)
