"""The draft controller picks the number of drafts with the most tokens per second, from what it measured."""

from __future__ import annotations

from hybridserve.engine.spec_decode.control import DraftController


def _teach(control: DraftController, seconds: dict[tuple[bool, int], float], acceptance: float) -> None:
    """Feed step times (per drafting kind and token count) and verifications at ``acceptance``."""
    for _ in range(40):
        for (drafting, tokens), s in seconds.items():
            control.record_step(s, tokens, drafting)
        hits = round(acceptance * 10)
        for i in range(10):
            control.record_verified(1, 1 if i < hits else 0)


def test_times_each_kind_of_step_first() -> None:
    control = DraftController(3)
    assert control.choose(4) == 3
    control.record_step(0.01, 16, drafting=True)
    assert control.choose(4) == 0
    control.record_step(0.01, 4, drafting=False)
    assert control.choose(4) in range(4)


def test_drafts_where_steps_cost_little_more_and_stops_where_they_cost_much_more() -> None:
    flat = DraftController(2)  # launch-bound (a GPU at small batch): more tokens cost almost nothing
    _teach(
        flat,
        {(False, 1): 0.010, (True, 2): 0.011, (True, 3): 0.012, (False, 16): 0.012, (True, 32): 0.013},
        0.8,
    )
    assert flat.choose(1) == 2
    linear = DraftController(2)  # compute-bound: a step costs in proportion to its tokens, MTP on top
    _teach(linear, {(False, 16): 0.016, (True, 32): 0.040, (True, 48): 0.060}, 0.6)
    assert linear.choose(16) == 0


def test_disable_by_batch_size_and_fixed_k() -> None:
    control = DraftController(2, adaptive=False, disable_by_batch_size=8)
    assert control.choose(7) == 2 and control.choose(8) == 0
    assert control.expected_tokens(0) == 1.0


def test_tries_the_runner_up_soon_after_the_start_then_every_32_steps() -> None:
    control = DraftController(2)
    _teach(control, {(False, 1): 0.010, (True, 2): 0.011, (True, 3): 0.012}, 0.8)
    picks = [control.choose(1) for _ in range(64)]
    assert [step for step, c in enumerate(picks, start=1) if c != 2] == [4, 8, 16, 32, 64]
