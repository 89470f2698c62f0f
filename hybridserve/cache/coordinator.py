"""Per-request block tables for every cache group: admit, extend, truncate, release, prefix reuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.cache.plan import CachePlan, GroupPlan
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.prefix import block_hashes
from hybridserve.cache.spec import GroupKind


@dataclass
class PrefixHit:
    """A reusable prefix: ``num_tokens`` cached tokens and, per group, the blocks that hold them."""

    num_tokens: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)
    # per rebuildable group, the span [a, num_tokens) of rows it found no block for (null entries)
    unwritten: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _RequestBlocks:
    tables: dict[str, list[int]]
    hashes: list[bytes] = field(default_factory=list)
    recycled: dict[str, int] = field(default_factory=dict)  # leading table entries already null
    num_published: int = 0
    # per group, positions [a, b) whose rows were never written (a drafter's window left behind while
    # speculation was off): never published, and the drafter reads its window only from b on
    unwritten: dict[str, tuple[int, int]] = field(default_factory=dict)
    # (from, start below, end at most): allocate(start, end) within these bounds changes nothing (a
    # decode inside its block, no window block to recycle); None: unknown, the tables just changed.
    quiet: tuple[int, int, int] | None = None


class KvCacheCoordinator:
    """Owns every request's block tables; the only code that takes or returns blocks.

    Logical block j covers tokens [j*B, (j+1)*B) in every group. History groups keep all their
    blocks; window groups keep the blocks covering the last ``window_tokens + lookback`` tokens
    before the next token to compute and recycle the rest (table entry set to the null block).
    ``lookback`` keeps extra window context so that truncating to ``lookback`` tokens before the
    furthest allocation start stays possible (speculative rollback never truncates before it).
    """

    def __init__(
        self,
        plan: CachePlan,
        pools: BlockPoolSet,
        enable_prefix_caching: bool = True,
        lookback: int = 0,
        hash_salt: bytes = b"",
    ) -> None:
        self.hash_salt = hash_salt  # e.g. the cache dtype: rows of another representation never match
        self.plan = plan
        self.pools = pools
        self.enable_prefix_caching = enable_prefix_caching
        self.lookback = lookback
        self.block_tokens = plan.block_tokens
        # Window groups whose rows a request may hold unwritten and rebuilds as it goes (a drafter's
        # window): a prefix hit takes the blocks of theirs it finds and starts the rest unwritten.
        self.rebuildable: frozenset[str] = frozenset()
        self._requests: dict[str, _RequestBlocks] = {}

    # ---- geometry -------------------------------------------------------------------------
    def _first_kept(self, g: GroupPlan, start: int) -> int:
        """Index of the first logical block that must stay readable when computing from ``start``."""
        if g.spec.kind is GroupKind.HISTORY:
            return 0
        return max(0, start - g.spec.window_tokens - self.lookback) // self.block_tokens

    def _first_needed(self, g: GroupPlan, start: int) -> int:
        """Index of the first block the next forward reads (the window without lookback)."""
        if g.spec.kind is GroupKind.HISTORY:
            return 0
        return max(0, start - g.spec.window_tokens) // self.block_tokens

    def blocks_needed(self, start: int, end: int) -> dict[str, int]:
        """Blocks a fresh request needs in each group to compute tokens [start, end)."""
        last = (end - 1) // self.block_tokens
        return {g.spec.name: last - self._first_kept(g, start) + 1 for g in self.plan.groups}

    def extension_cost(self, req_id: str, start: int, end: int) -> dict[str, int]:
        """Per group, how much ``num_free`` would drop if ``allocate(req_id, start, end)`` ran now.

        New blocks minus the window blocks that allocation would recycle (only those no other request
        shares), so it can be negative. Read-only; an unknown request counts as having no blocks.
        """
        assert end > start >= 0
        req = self._requests.get(req_id)
        last = (end - 1) // self.block_tokens
        cost: dict[str, int] = {}
        for g in self.plan.groups:
            name = g.spec.name
            table = req.tables[name] if req is not None else []
            first, done = self._first_kept(g, start), req.recycled.get(name, 0) if req is not None else 0
            ref_counts = self.pools[name].ref_counts
            dead = table[done : min(first, len(table))]
            freed = sum(1 for b in dead if b != NULL_BLOCK and ref_counts[b] == 1)
            cost[name] = max(0, last + 1 - max(first, len(table))) - freed
        return cost

    # ---- lifecycle ------------------------------------------------------------------------
    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def block_tables(self, req_id: str) -> dict[str, list[int]]:
        return self._requests[req_id].tables

    def allocate(self, req_id: str, start: int, end: int) -> bool:
        """Make tokens [start, end) writable (and the window before ``start`` readable).

        All-or-nothing across groups: on failure nothing changes. On success, window blocks that
        no later token can see are recycled first, so they count towards the new blocks.
        """
        assert end > start >= 0
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _RequestBlocks({g.spec.name: [] for g in self.plan.groups})
        if req.quiet is not None and req.quiet[0] <= start < req.quiet[1] and end <= req.quiet[2]:
            return True
        if not self._allocate(req, start, end):
            return False
        req.quiet = self._quiet_bounds(req, start)
        return True

    def _quiet_bounds(self, req: _RequestBlocks, start: int) -> tuple[int, int, int]:
        """Bounds within which ``allocate`` has nothing to do: every token's block is held, and no
        window group's first kept block passes what it already recycled."""
        below, most = 1 << 62, 1 << 62
        for g in self.plan.groups:
            name = g.spec.name
            most = min(most, len(req.tables[name]) * self.block_tokens)
            if g.spec.kind is not GroupKind.HISTORY:
                done = req.recycled.get(name, 0)
                below = min(below, (done + 1) * self.block_tokens + g.spec.window_tokens + self.lookback)
        return start, below, most

    def _allocate(self, req: _RequestBlocks, start: int, end: int) -> bool:
        last = (end - 1) // self.block_tokens
        dead: dict[str, list[int]] = {}
        missing: dict[str, int] = {}
        for g in self.plan.groups:
            name = g.spec.name
            table = req.tables[name]
            first, done = self._first_kept(g, start), req.recycled.get(name, 0)
            assert self._first_needed(g, start) >= done, (
                f"{name}: window context before token {start} was already recycled"
            )
            dead[name] = [b for b in table[done : min(first, len(table))] if b != NULL_BLOCK]
            missing[name] = last + 1 - max(first, len(table))
        new: dict[str, list[int]] | None = {}
        if any(dead.values()) or any(n > 0 for n in missing.values()):  # else a decode inside its block
            new = self.pools.allocate(missing, release=dead)
        if new is None:
            return False
        for g in self.plan.groups:
            name, table = g.spec.name, req.tables[g.spec.name]
            first = min(self._first_kept(g, start), len(table))
            done = req.recycled.get(name, 0)
            if first > done:
                table[done:first] = [NULL_BLOCK] * (first - done)
                req.recycled[name] = first
            pad = self._first_kept(g, start) - len(table)
            if pad > 0:
                table.extend([NULL_BLOCK] * pad)
                req.recycled[name] = len(table)
        for name, blocks in new.items():
            req.tables[name].extend(blocks)
            assert len(req.tables[name]) == last + 1
        return True

    def release(self, req_id: str) -> None:
        """Return every block of a finished, aborted or preempted request."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        for g in self.plan.groups:
            table = req.tables[g.spec.name]
            # LRU order: a history prefix is worth most at its start, so its tail is freed first (and
            # evicted first); a window group's last blocks are the context a hit at the end needs.
            self.pools[g.spec.name].free(table[::-1] if g.spec.kind is GroupKind.HISTORY else table)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Forget tokens from ``num_tokens`` on (speculative rollback); frees blocks past the end."""
        req = self._requests[req_id]
        keep = -(-num_tokens // self.block_tokens)
        if any(len(table) > keep for table in req.tables.values()):  # else ``quiet`` stays true
            req.quiet = None
            for name, table in req.tables.items():
                self.pools[name].free(table[keep:][::-1])
                del table[keep:]
                req.recycled[name] = min(req.recycled.get(name, 0), keep)
        req.hashes = req.hashes[: num_tokens // self.block_tokens]
        req.num_published = min(req.num_published, len(req.hashes))
        for name, (a, b) in list(req.unwritten.items()):
            if min(b, num_tokens) <= a:
                del req.unwritten[name]
            else:
                req.unwritten[name] = (a, min(b, num_tokens))

    def mark_unwritten(self, req_id: str, group: str, start: int, end: int) -> None:
        """Rows [start, end) of ``group`` were computed but not written (kept as one span, the hull)."""
        req = self._requests[req_id]
        a, b = req.unwritten.get(group, (start, end))
        req.unwritten[group] = (min(a, start), max(b, end))

    def unwritten(self, req_id: str, group: str) -> tuple[int, int]:
        """The span [a, b) holding every row of ``group`` the request computed but never wrote (a == b:
        none); from b on every row is written."""
        return self._requests[req_id].unwritten.get(group, (0, 0))

    # ---- prefix caching -------------------------------------------------------------------
    def probe(self, token_ids: list[int]) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` that can be resumed (at least one token left).

        A hit at L needs every history block covering [0, L) and, for each window group, the blocks
        covering the context before L that the next token can still see; of a ``rebuildable`` group,
        those it finds (the rest start as unwritten rows).
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        hashes = block_hashes(token_ids, self.block_tokens, salt=self.hash_salt)
        max_blocks = min(len(hashes), (len(token_ids) - 1) // self.block_tokens)
        n = self._history_run(hashes[:max_blocks])
        while n > 0:
            hit = self._hit_at(hashes, n)
            if hit is not None:
                return hit
            n -= 1
        return PrefixHit()

    def _history_run(self, hashes: list[bytes]) -> int:
        n = len(hashes)
        for g in self.plan.groups:
            if g.spec.kind is GroupKind.HISTORY:
                pool = self.pools[g.spec.name]
                run = 0
                while run < n and pool.lookup(hashes[run]) is not None:
                    run += 1
                n = run
        return n

    def _hit_at(self, hashes: list[bytes], n: int) -> PrefixHit | None:
        end = n * self.block_tokens
        hit = PrefixHit(num_tokens=end)
        for g in self.plan.groups:
            name = g.spec.name
            pool = self.pools[name]
            first = self._first_needed(g, end)
            table = [NULL_BLOCK] * first
            for j in range(first, n):
                block = pool.lookup(hashes[j])
                if block is None:
                    if name not in self.rebuildable:
                        return None
                    hit.unwritten.setdefault(name, (j * self.block_tokens, end))
                    block = NULL_BLOCK
                table.append(block)
            hit.blocks[name] = table
        return hit

    def admit_prefix(self, req_id: str, hit: PrefixHit, token_ids: list[int]) -> None:
        """Start a request's tables from a prefix hit, taking a reference to each shared block."""
        assert req_id not in self._requests
        for name, table in hit.blocks.items():
            for b in table:
                if b != NULL_BLOCK:
                    self.pools[name].touch(b)
        req = _RequestBlocks({g.spec.name: list(hit.blocks.get(g.spec.name, [])) for g in self.plan.groups})
        for g in self.plan.groups:
            req.recycled[g.spec.name] = self._first_needed(g, hit.num_tokens)
        n = hit.num_tokens // self.block_tokens
        req.hashes = block_hashes(token_ids[: hit.num_tokens], self.block_tokens, salt=self.hash_salt)
        req.num_published = n
        req.unwritten = dict(hit.unwritten)
        self._requests[req_id] = req

    def publish(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publish the request's newly filled blocks under their prefix hashes (not a group's blocks that
        hold rows never written: a later hit must find that group's block missing, not read them)."""
        if not self.enable_prefix_caching:
            return
        req = self._requests[req_id]
        full = num_computed // self.block_tokens
        if full <= req.num_published:
            return
        parent = req.hashes[-1] if req.hashes else b""
        req.hashes += block_hashes(
            token_ids[: full * self.block_tokens], self.block_tokens, parent, len(req.hashes), self.hash_salt
        )
        for j in range(req.num_published, full):
            for name, table in req.tables.items():
                if table[j] != NULL_BLOCK and not self._holds_unwritten(req, name, j):
                    self.pools[name].publish(table[j], req.hashes[j])
        req.num_published = full

    def _holds_unwritten(self, req: _RequestBlocks, group: str, j: int) -> bool:
        a, b = req.unwritten.get(group, (0, 0))
        return a < (j + 1) * self.block_tokens and j * self.block_tokens < b

    def reset_prefix_cache(self) -> None:
        for pool in self.pools.pools.values():
            pool.reset_prefix_cache()
