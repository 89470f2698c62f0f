"""A prefix hit that does not need a rebuildable group's blocks (a drafter's window, which plain steps
leave unwritten): it takes the blocks of that group it finds, starts the rest as unwritten rows, and the
pools stay consistent."""

from __future__ import annotations

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from tests.cache.helpers import toy_specs

BLOCK = 4


def _coordinator() -> KvCacheCoordinator:
    plan = build_plan(toy_specs(window=5), BLOCK, 2, 64, num_blocks=40)
    return KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"))


def _served_once(coordinator: KvCacheCoordinator, tokens: list[int], unwritten: tuple[int, int]) -> None:
    """A request computes ``tokens`` leaving the "win" group's rows ``unwritten``, publishes, finishes."""
    assert coordinator.allocate("a", 0, len(tokens))
    coordinator.mark_unwritten("a", "win", *unwritten)
    coordinator.publish("a", tokens, len(tokens))
    coordinator.release("a")


def test_a_hit_past_unwritten_rows_needs_a_rebuildable_group() -> None:
    tokens = list(range(100, 125))
    strict = _coordinator()
    _served_once(strict, tokens, (8, 20))
    assert strict.probe([*tokens, 7]).num_tokens == 8  # the window before 24 lies in unwritten blocks

    coordinator = _coordinator()
    coordinator.rebuildable = frozenset({"win"})
    _served_once(coordinator, tokens, (8, 20))
    hit = coordinator.probe([*tokens, 7])
    assert hit.num_tokens == 24
    assert hit.unwritten == {"win": (16, 24)}  # the window before 24: block 4 missing, block 5 found
    win = hit.blocks["win"]
    assert win[:5] == [NULL_BLOCK] * 5 and win[5] != NULL_BLOCK
    assert all(b != NULL_BLOCK for b in hit.blocks["rows"])

    coordinator.admit_prefix("b", hit, [*tokens, 7])
    assert coordinator.unwritten("b", "win") == (16, 24)
    assert coordinator.allocate("b", 24, 26)
    table = coordinator.block_tables("b")["win"]
    assert table[6] != NULL_BLOCK  # the new tokens' rows are written as usual
    coordinator.publish("b", [*tokens, 7, 8], 26)
    coordinator.release("b")
    coordinator.pools.check_integrity()
    coordinator.reset_prefix_cache()
    assert coordinator.pools.all_free()


def test_a_non_rebuildable_group_still_needs_its_blocks() -> None:
    coordinator = _coordinator()
    coordinator.rebuildable = frozenset({"win"})
    tokens = list(range(100, 125))
    assert coordinator.allocate("a", 0, len(tokens))
    coordinator.mark_unwritten("a", "state", 8, 24)
    coordinator.publish("a", tokens, len(tokens))
    coordinator.release("a")
    hit = coordinator.probe([*tokens, 7])
    assert hit.num_tokens == 8 and not hit.unwritten
