"""The coordinator against a simple reference: random admit / extend / truncate / release sequences."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import NULL_BLOCK, BlockPoolSet
from hybridserve.cache.spec import GroupKind
from tests.cache.helpers import toy_specs

BLOCK = 4
LOOKBACK = 3


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.plan = build_plan(toy_specs(window=5, rate=2), BLOCK, 4, 16, num_blocks=24)
        self.pools = BlockPoolSet(self.plan, "cpu")
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

    def teardown(self) -> None:
        for rid in list(self.lengths):
            self.coord.release(rid)
        assert self.pools.all_free()
        self.pools.check_integrity()


TestCoordinator = CoordinatorMachine.TestCase
TestCoordinator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PrefixSharingMachine(RuleBasedStateMachine):
    """Publishing, probing, sharing and eviction mixed with extends and releases."""

    def __init__(self) -> None:
        super().__init__()
        plan = build_plan(toy_specs(window=5, rate=2), BLOCK, 4, 16, num_blocks=20)
        self.pools = BlockPoolSet(plan, "cpu")
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

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.coord.release(rid)
        self.coord.reset_prefix_cache()
        assert self.pools.all_free()
        assert all(p.num_cached == 0 for p in self.pools.pools.values())
        self.pools.check_integrity()


TestPrefixSharing = PrefixSharingMachine.TestCase
TestPrefixSharing.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
