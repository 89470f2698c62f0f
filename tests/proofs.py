"""Proofs that a greedy mismatch against the reference is a tie, not a bug.

Every proof reads the reference's own incremental path (prefill, then one token at a time), the same
forward passes that produced its tokens, and states the numbers it rests on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.reference import GreedyTrace, greedy_trace

NEAR_TIE = 1e-5  # float32 logits of these models agree with the reference to ~1e-6


@dataclass(frozen=True)
class MismatchProof:
    step: int  # first generated token that differs from the reference
    kind: str  # "near-tie" or "indexer-tie"
    gap: float  # the reference's own top-2 logit gap at the step that decides
    tie_position: int | None = None  # query position of the exact indexer tie, for "indexer-tie"

    def __str__(self) -> str:
        where = "" if self.tie_position is None else f", exact indexer tie at position {self.tie_position}"
        return f"step {self.step}: {self.kind} (reference top-2 gap {self.gap:.2e}{where})"


def first_difference(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def _near_tie(trace: GreedyTrace, ours: list[int], step: int) -> bool:
    """The reference nearly tied at ``step`` and our token is its runner-up."""
    return trace.gaps[step] < NEAR_TIE and ours[step] == trace.top2[step][1]


def prove_mismatch(folder: Path, prompt: list[int], ours: list[int]) -> MismatchProof:
    """The proof that ``ours`` differs from the reference only by a tie; fails the test if there is none.

    Either the reference's top-2 logits at the divergence are within ``NEAR_TIE`` and ours is its
    second choice, or its indexer met an exact top-k tie at or before the divergence and, with only
    its tie order set to ours (lowest row first), it reproduces our tokens (up to a further near tie).
    """
    trace = greedy_trace(folder, tuple(prompt), len(ours))
    first = first_difference(ours, trace.tokens)
    if _near_tie(trace, ours, first):
        return MismatchProof(first, "near-tie", trace.gaps[first])
    tie = trace.first_tie_at_or_before(len(prompt) + first - 1)
    assert tie is not None, (
        f"divergence at step {first}: no exact indexer tie before it, reference top-2 "
        f"{trace.top2[first]} gap {trace.gaps[first]:.2e}, ours {ours[first]}"
    )
    stable = greedy_trace(folder, tuple(prompt), len(ours), stable=True)
    if list(stable.tokens) == ours:
        return MismatchProof(first, "indexer-tie", trace.gaps[first], tie)
    k = first_difference(ours, stable.tokens)
    assert _near_tie(stable, ours, k), (
        f"with our tie order the reference still differs at step {k}: top-2 {stable.top2[k]} "
        f"gap {stable.gaps[k]:.2e}, ours {ours[k]}"
    )
    return MismatchProof(k, "indexer-tie", stable.gaps[k], tie)
