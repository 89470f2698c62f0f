"""How many tokens to draft under the current load: speculation must never make a busy engine slower.

Drafting pays when the accepted tokens are worth more than the extra work of verifying and drafting;
under load (many running requests, a compute-bound step) it can cost more than it gains, and where the
balance lies depends on the device, the model, the graphs and the text. So it is measured, not assumed.
A step's time has three parts, each learned from the steps that ran it (``StepCost``):

* the trunk forward over T tokens (verification included), per quarter octave of T;
* the MTP layer's work for c drafts per request, per (c, octave of the running requests n);
* the rest (sampling, scheduling, commit), per octave of n.

With n requests drafting c tokens each, a step verifies n (1 + c) tokens and yields n E(c) of them, E(c) =
1 + a_1 + a_1 a_2 + ... (a_i the acceptance at position i); the controller picks the c in 0..k with the
most tokens per second. Parts never measured are scaled from the nearest measured ones; at each octave of
n, each kind of step (drafting k, drafting none) is tried once first, and now and then (soon after the
start, then every RETRY_EVERY steps) the runner-up is tried again, so estimates follow the load. Keeping
the parts apart matters: a step that drafts none may still verify the drafts of the step before, so a
whole-step time filed under its own choice would make not drafting look dear.
vLLM's static ``disable_by_batch_size`` is honoured on top: no drafts while that many requests run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar

EMA = 0.3  # weight of a new measurement
PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft was verified
RETRY_EVERY = 32  # steps between tries of the runner-up
K = TypeVar("K")


@dataclass(frozen=True)
class StepCost:
    """One speculative step, timed: its trunk forward over ``tokens`` tokens, the MTP work of ``drafts``
    drafts per request while ``requests`` requests ran, and the whole step."""

    seconds: float
    trunk_seconds: float
    draft_seconds: float
    tokens: int
    requests: int
    drafts: int


def _token_bucket(tokens: int) -> int:
    """Quarter octaves: 16, 32 and 48 tokens (16 requests drafting 0, 1, 2) fall in different buckets."""
    return round(4 * math.log2(max(tokens, 1)))


def _request_bucket(requests: int) -> int:
    return max(requests, 1).bit_length()


@dataclass
class DraftController:
    k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    trunk_seconds: dict[int, float] = field(default_factory=dict)  # token bucket -> s
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (c, request bucket) -> s
    other_seconds: dict[int, float] = field(default_factory=dict)  # request bucket -> s
    acceptance: list[float] = field(default_factory=list)
    _steps: int = 0

    def __post_init__(self) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * self.k

    def choose(self, num_running: int) -> int:
        """Drafts per request for the next step (0: no MTP work at all)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or num_running == 0:
            return self.k
        self._steps += 1
        n, b = num_running, _request_bucket(num_running)
        for c in (self.k, 0):  # at every size of load, each kind of step is timed once first
            if (c, b) not in self.draft_seconds:
                return c
        rate = {c: n * self.expected_tokens(c) / self.estimate(c, n) for c in range(self.k + 1)}
        ranked = sorted(rate, key=lambda c: -rate[c])
        return ranked[1] if self._retry_due() and len(ranked) > 1 else ranked[0]

    def estimate(self, c: int, n: int) -> float:
        """The expected seconds of a step of n requests drafting c each, in steady state."""
        return self._trunk(n * (1 + c)) + self._draft(c, n) + _nearest(self.other_seconds, _request_bucket(n))

    def _retry_due(self) -> bool:
        """Steps 4, 8 and 16, then every RETRY_EVERY: a first timing taken during a load spike is
        corrected within a short request, not only after RETRY_EVERY steps."""
        return self._steps in (4, 8, 16) or self._steps % RETRY_EVERY == 0

    def _trunk(self, tokens: int) -> float:
        """Measured at that size, or scaled from the nearest measured size by the square root of the ratio
        (between a flat, launch-bound step and a linear, compute-bound one; a size that is then chosen
        gets measured)."""
        b = _token_bucket(tokens)
        near = min(self.trunk_seconds, key=lambda t: (abs(t - b), t))
        return self.trunk_seconds[near] * 2 ** ((b - near) / 8)

    def _draft(self, c: int, n: int) -> float:
        """The MTP work of c drafts per request: measured for (c, n's size), else scaled from the nearest
        measured c at n's size by the number of MTP layer runs (``choose`` times k and 0 there first)."""
        b = _request_bucket(n)
        if (c, b) in self.draft_seconds:
            return self.draft_seconds[(c, b)]
        drafting = {dc: s for (dc, rb), s in self.draft_seconds.items() if dc > 0 and rb == b}
        near = min(drafting, key=lambda d: abs(d - c))
        return drafting[near] * c / near

    def expected_tokens(self, c: int) -> float:
        """Tokens one request gains from a step verifying ``c`` drafts."""
        total, reach = 1.0, 1.0
        for a in self.acceptance[:c]:
            reach *= a
            total += reach
        return total

    def record_step(self, cost: StepCost) -> None:
        """A step's timed parts (see the module docstring)."""
        if cost.seconds <= 0 or cost.tokens <= 0:
            return
        b = _request_bucket(cost.requests)
        _update(self.trunk_seconds, _token_bucket(cost.tokens), cost.trunk_seconds)
        _update(self.draft_seconds, (cost.drafts, b), cost.draft_seconds)
        _update(self.other_seconds, b, max(cost.seconds - cost.trunk_seconds - cost.draft_seconds, 0.0))

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: drafts 0..num_accepted-1 accepted, the next one (if any) not."""
        for i in range(min(num_accepted + 1, num_drafts)):
            hit = 1.0 if i < num_accepted else 0.0
            self.acceptance[i] = (1 - EMA / 4) * self.acceptance[i] + EMA / 4 * hit


def _update(table: dict[K, float], key: K, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds


def _nearest(table: dict[int, float], key: int) -> float:
    return table[min(table, key=lambda k: (abs(k - key), k))]
