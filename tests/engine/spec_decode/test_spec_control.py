"""The draft controller picks the number of drafts with the most tokens per second, from what it measured."""

from __future__ import annotations

from hybridserve.engine.spec_decode.control import DraftController, StepCost

MS = 1e-3


def _step(
    n: int, verified: int, drafts: int, trunk_ms: float, draft_ms: float, other_ms: float = 1.0
) -> StepCost:
    """A step of n requests that verifies ``verified`` drafts each and drafts ``drafts`` each."""
    total = (trunk_ms + draft_ms + other_ms) * MS
    return StepCost(total, trunk_ms * MS, draft_ms * MS, n * (1 + verified), n, drafts)


def _teach(control: DraftController, steps: list[StepCost], acceptance: float) -> None:
    """Feed the steps and verifications at ``acceptance``, many times over."""
    for _ in range(40):
        for step in steps:
            control.record_step(step)
        hits = round(acceptance * 10)
        for i in range(10):
            control.record_verified(1, 1 if i < hits else 0)


def test_times_each_kind_of_step_first() -> None:
    control = DraftController(3)
    assert control.choose(4) == 3
    control.record_step(_step(4, 0, 3, 10, 3))
    assert control.choose(4) == 0
    control.record_step(_step(4, 3, 0, 12, 0.2))
    assert control.choose(4) in range(4)


def test_drafts_where_steps_cost_little_more_and_stops_where_they_cost_much_more() -> None:
    # launch-bound (a GPU at small batch): more tokens cost almost nothing
    flat = DraftController(2)
    _teach(flat, [_step(1, 0, 0, 10, 0.1), _step(1, 2, 2, 11, 1), _step(1, 1, 1, 10.5, 0.5)], 0.8)
    assert flat.choose(1) == 2
    # compute-bound: a step costs in proportion to its tokens, MTP on top
    linear = DraftController(2)
    _teach(linear, [_step(16, 0, 0, 16, 0.5), _step(16, 2, 2, 48, 12)], 0.6)
    assert linear.choose(16) == 0


def test_a_step_that_drafts_none_is_not_blamed_for_verifying_the_drafts_before_it() -> None:
    """Alternating choices: a step that drafts none verifies the last step's drafts (a dear trunk forward)
    and one that drafts verifies none (a cheap one). Filed by the whole step under its own choice, not
    drafting would look dearer than drafting; with the parts kept apart the controller sees that drafting
    costs 48 ms of trunk a step where not drafting costs 16, and stops."""
    control = DraftController(2)
    after_drafting = _step(16, 2, 0, 48, 0.5)  # drafts none, verifies 2 each
    after_plain = _step(16, 0, 2, 16, 12)  # drafts 2, verifies none
    _teach(control, [after_drafting, after_plain], 0.7)
    assert control.estimate(0, 16) < control.estimate(2, 16) / 2
    assert control.choose(16) == 0


def test_disable_by_batch_size_and_fixed_k() -> None:
    control = DraftController(2, adaptive=False, disable_by_batch_size=8)
    assert control.choose(7) == 2 and control.choose(8) == 0
    assert control.expected_tokens(0) == 1.0


def test_tries_the_runner_up_soon_after_the_start_then_every_32_steps() -> None:
    control = DraftController(2)
    _teach(control, [_step(1, 0, 0, 10, 0.1), _step(1, 2, 2, 11, 1), _step(1, 1, 1, 10.5, 0.5)], 0.8)
    picks = [control.choose(1) for _ in range(64)]
    assert [step for step, c in enumerate(picks, start=1) if c != 2] == [4, 8, 16, 32, 64]
