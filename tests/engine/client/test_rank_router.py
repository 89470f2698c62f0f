"""RankRouter: least-loaded rank, prefix affinity within a slack, loads follow finishes."""

from __future__ import annotations

from hybridserve.engine.client.rank_router import PREFIX_SLACK, PREFIX_STEP, RankRouter


def test_new_requests_go_to_the_least_loaded_rank_and_finishes_free_it() -> None:
    router = RankRouter(3)
    ranks = [router.assign(f"r{i}", [i] * 5) for i in range(6)]
    assert ranks == [0, 1, 2, 0, 1, 2] and router.load == [2, 2, 2]
    router.forget("r1")
    router.forget("r4")
    assert router.assign("new", [99]) == 1
    assert router.by_owner(["r0", "r2", "new", "gone"]) == {0: ["r0"], 2: ["r2"], 1: ["new"]}


def test_a_shared_prefix_goes_to_its_rank_while_that_costs_at_most_the_slack() -> None:
    router = RankRouter(2)
    system = list(range(100, 100 + 2 * PREFIX_STEP))
    assert router.assign("a", [*system, 1, 2]) == 0
    placed = [router.assign(f"b{i}", [*system, i]) for i in range(PREFIX_SLACK + 1)]
    assert placed == [0] * PREFIX_SLACK + [1]  # rank 0 holds the prefix until it has SLACK more requests
    assert router.assign("c", [*system, 7]) == 1  # the prefix now lives on rank 1 too: its latest rank
    assert router.assign("short", system[: PREFIX_STEP - 1]) == 1  # under one step: no prefix known
