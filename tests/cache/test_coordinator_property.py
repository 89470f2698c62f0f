"""The coordinator against a simple reference: random admit / extend / truncate / release sequences."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.cache.spec import GroupKind
from tests.cache.helpers import toy_specs

pytestmark = pytest.mark.slow_file(seconds=50)  # scheduled first: never the run's tail

BLOCK = 4
LOOKBACK = 3


class BlockContents:
    """A tag written into every referenced or cached block of every group, checked after each rule: a
    block whose bytes another group's block overlaps, or that a hand-out elsewhere zeroed, loses it."""

    def __init__(self, pools: BlockPoolSet) -> None:
        self.pools = pools
        self.tags: dict[tuple[str, int], float] = {}
        self.next_tag = 1.0
        for name, pool in pools.pools.items():
            pool._zero = self._forgetting(name, pool._zero)  # type: ignore[method-assign]

    def _forgetting(self, name: str, zero: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
        def zero_and_forget(blocks: list[int]) -> None:
            zero(blocks)
            for b in blocks:
                self.tags.pop((name, b), None)

        return zero_and_forget

    def check_and_tag(self, live: dict[str, set[int]]) -> None:
        self.tags = {(n, b): v for (n, b), v in self.tags.items() if b in live[n]}
        for (name, b), tag in self.tags.items():
            for t in self._rows(name, b):
                assert torch.all(t == tag), f"{name}: block {b} lost its contents"
        for name, blocks in live.items():
            for b in blocks - {NULL_BLOCK}:
                if (name, b) not in self.tags:
                    self.tags[(name, b)] = self.next_tag
                    self.next_tag += 1
                    for t in self._rows(name, b):
                        t.fill_(self.tags[(name, b)])

    def _rows(self, name: str, block: int) -> list[torch.Tensor]:
        pool = self.pools[name]
        r = pool.plan.rows_per_block
        return [t[block * r : (block + 1) * r] for t in pool.tensors.values()]


class CoordinatorMachine(RuleBasedStateMachine):
    LAYOUT = "fixed"

    def __init__(self) -> None:
        super().__init__()
        self.plan = build_plan(toy_specs(window=5, rate=2), BLOCK, 4, 16, num_blocks=24, layout=self.LAYOUT)
        self.pools = BlockPoolSet(self.plan, "cpu")
        self.contents = BlockContents(self.pools)
        self.coord = KvCacheCoordinator(self.plan, self.pools, enable_prefix_caching=False, lookback=LOOKBACK)
        self.lengths: dict[str, int] = {}  # the reference: tokens each live request has written
        self.starts: dict[str, int] = {}  # furthest start of each request's allocations
        self.next_id = 0

    @rule(n=st.integers(1, 20))
    def admit(self, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        free_before = {k: p.num_free for k, p in self.pools.pools.items()}
        if self.coord.allocate(rid, 0, n):
            self.lengths[rid], self.starts[rid] = n, 0
        else:
            assert {k: p.num_free for k, p in self.pools.pools.items()} == free_before
            self.coord.release(rid)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), k=st.integers(1, 9))
    def extend(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        if self.coord.allocate(rid, self.lengths[rid], self.lengths[rid] + k):
            self.starts[rid] = max(self.starts[rid], self.lengths[rid])
            self.lengths[rid] += k

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), k=st.integers(1, LOOKBACK))
    def truncate(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        new_len = max(1, self.lengths[rid] - k, self.starts[rid] - LOOKBACK)
        self.coord.truncate(rid, new_len)
        self.lengths[rid] = new_len

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.lengths)))
        self.coord.release(rid)
        del self.lengths[rid], self.starts[rid]

    @invariant()
    def tables_match_the_reference(self) -> None:
        for g in self.plan.groups:
            name = g.spec.name
            held: list[int] = []
            for rid, n in self.lengths.items():
                table = self.coord.block_tables(rid)[name]
                assert len(table) == -(-n // BLOCK)
                live = [j for j, b in enumerate(table) if b != NULL_BLOCK]
                held += [table[j] for j in live]
                if g.spec.kind is GroupKind.HISTORY:
                    assert live == list(range(len(table)))
                else:  # the window before the next token is present; older blocks were recycled
                    recycled_below = max(0, self.starts[rid] - g.spec.window_tokens - LOOKBACK) // BLOCK
                    assert all(j >= recycled_below for j in live)
                    needed = max(0, n - g.spec.window_tokens) // BLOCK
                    assert all(table[j] != NULL_BLOCK for j in range(needed, len(table))), (
                        name,
                        n,
                        self.starts[rid],
                        table,
                    )
            assert len(held) == len(set(held)), f"{name}: a block is held twice"
            assert self.pools[name].num_used == len(held), f"{name}: leaked or lost blocks"
            self.pools[name].check_integrity()
        self.pools.check_integrity()  # with the arena: pages partition the arena, one owner each

    @invariant()
    def blocks_keep_their_contents(self) -> None:
        tables = [self.coord.block_tables(rid) for rid in self.lengths]
        live = {n: {b for t in tables for b in t[n]} for n in self.pools.pools}
        self.contents.check_and_tag(live)

    def teardown(self) -> None:
        for rid in list(self.lengths):
            self.coord.release(rid)
        assert self.pools.all_free()
        self.pools.check_integrity()


TestCoordinator = CoordinatorMachine.TestCase
TestCoordinator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class ArenaCoordinatorMachine(CoordinatorMachine):
    """The same sequences with every group drawing pages from one arena of the same bytes."""

    LAYOUT = "arena"


TestArenaCoordinator = ArenaCoordinatorMachine.TestCase
TestArenaCoordinator.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class PrefixSharingMachine(RuleBasedStateMachine):
    """Publishing, probing, sharing and eviction mixed with extends and releases."""

    LAYOUT = "fixed"

    def __init__(self) -> None:
        super().__init__()
        plan = build_plan(toy_specs(window=5, rate=2), BLOCK, 4, 16, num_blocks=20, layout=self.LAYOUT)
        self.pools = BlockPoolSet(plan, "cpu")
        self.contents = BlockContents(self.pools)
        self.coord = KvCacheCoordinator(plan, self.pools, enable_prefix_caching=True)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0
        self.was_reset = False  # a reset unpublishes blocks that running requests still share

    def _run(self, rid: str, start: int, tokens: list[int]) -> bool:
        if not self.coord.allocate(rid, start, len(tokens)):
            return False
        self.coord.publish(rid, tokens, len(tokens))
        self.tokens[rid] = tokens
        return True

    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def admit(self, data: st.DataObject, extra: list[int]) -> None:
        base: list[int] = []
        if self.tokens:
            donor = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
            base = donor[: data.draw(st.integers(0, len(donor)))]
        tokens = base + extra
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.coord.probe(tokens)
        assert hit.num_tokens % BLOCK == 0 and hit.num_tokens < len(tokens)
        if hit.num_tokens:
            self.coord.admit_prefix(rid, hit, tokens)
        if not self._run(rid, hit.num_tokens, tokens):
            self.coord.release(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def extend(self, data: st.DataObject, extra: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._run(rid, len(self.tokens[rid]), self.tokens[rid] + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.coord.release(rid)
        del self.tokens[rid]

    @rule()
    def reset(self) -> None:
        self.coord.reset_prefix_cache()
        self.was_reset = True

    @invariant()
    def refcounts_equal_references(self) -> None:
        for name, pool in self.pools.pools.items():
            refs: dict[int, int] = {}
            for rid in self.tokens:
                table = [b for b in self.coord.block_tables(rid)[name] if b != NULL_BLOCK]
                assert len(table) == len(set(table)), f"{name}: a block twice in one table"
                for b in table:
                    refs[b] = refs.get(b, 0) + 1
            for b in range(1, pool.num_blocks):
                assert pool.ref_counts[b] == refs.get(b, 0), f"{name}: block {b} refcount"
                if refs.get(b, 0) > 1 and not self.was_reset:
                    assert pool.block_hash[b] is not None, f"{name}: unpublished block {b} shared"
            pool.check_integrity()
        self.pools.check_integrity()

    @invariant()
    def blocks_keep_their_contents(self) -> None:
        """Referenced and cached blocks keep their bytes (cached ones until evicted or reclaimed)."""
        live = {
            n: {b for rid in self.tokens for b in self.coord.block_tables(rid)[n]} | set(p._cached.values())
            for n, p in self.pools.pools.items()
        }
        self.contents.check_and_tag(live)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.coord.release(rid)
        self.coord.reset_prefix_cache()
        assert self.pools.all_free()
        assert all(p.num_cached == 0 for p in self.pools.pools.values())
        self.pools.check_integrity()


TestPrefixSharing = PrefixSharingMachine.TestCase
TestPrefixSharing.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class ArenaPrefixSharingMachine(PrefixSharingMachine):
    """Prefix sharing over one arena: parked pages, hits that revive them, reclaims across groups."""

    LAYOUT = "arena"


TestArenaPrefixSharing = ArenaPrefixSharingMachine.TestCase
TestArenaPrefixSharing.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_quiet_decodes_change_nothing_the_full_allocation_would() -> None:
    """allocate's fast path (a decode inside held blocks, nothing to recycle) leaves the same tables and
    free counts as the full allocation, token by token through block ends and window recycling."""
    coords = []
    for quiet in (True, False):
        plan = build_plan(toy_specs(window=5, rate=2), BLOCK, 4, 16, num_blocks=24)
        coord = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False, lookback=1)
        if not quiet:
            coord._quiet_bounds = lambda req, start: None  # type: ignore[assignment,method-assign,return-value]
        coords.append(coord)
    for coord in coords:
        assert coord.allocate("a", 0, 3) and coord.allocate("b", 0, 6)
    fast = 0
    for pos in range(3, 40):
        for coord in coords:
            req = coord._requests["a"]
            fast += coord is coords[0] and req.quiet is not None and req.quiet[1] > pos and req.quiet[2] > pos
            assert coord.allocate("a", pos, pos + 1)
        a, b = coords
        assert a.block_tables("a") == b.block_tables("a")
        assert {k: p.num_free for k, p in a.pools.pools.items()} == {
            k: p.num_free for k, p in b.pools.pools.items()
        }
    assert 10 < fast < 37  # most decodes took the fast path, block ends and recycling did not
