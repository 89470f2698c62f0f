"""How many tokens to draft under the current load: speculation must never make a busy engine slower.

Drafting pays when the accepted tokens are worth more than the extra work of verifying and drafting;
under load (many running requests, a compute-bound step) it can cost more than it gains, and where the
balance lies depends on the device, the model, the graphs and the text. So it is measured, not assumed.
The controller picks one of two kinds of step:

* drafting c >= 1 tokens per request (those whose MTP windows are whole, ``ready``): a speculative step;
* 0, a plain step: the trunk forward and the plain sampler, nothing of the drafter. It leaves the MTP
  layer's window rows of its positions unwritten, so a request drafts again only once a window's worth of
  rows has been written after them (engine/spec_decode/decoder.py).

A step's time has three parts, each learned from the steps that ran it (``StepCost``):

* the trunk forward over T tokens (verification included), per quarter octave of T;
* the MTP work of c drafts per request, per (c, octave of the drafting requests r);
* the rest (sampling, scheduling, commit), per (kind of step, octave of the running requests n).

With n requests of which r draft c tokens each, a step verifies n + r c tokens and yields n + r (E(c) - 1)
of them, E(c) = 1 + a_1 + a_1 a_2 + ... (a_i the acceptance at position i); a plain step yields n. The
controller picks the choice with the most tokens per second. Parts never measured are scaled from the
nearest measured ones. At each octave of n, drafting k (once some request can) and a plain step are each
timed once first, and now and then (steps 4, 8, 16, then every RETRY_EVERY) the runner-up is tried again,
so estimates follow the load. A plain step that is such a try writes the window rows after it is timed,
so trying costs no drafting later; switching between plain and drafting as the choice takes a margin
(SWITCH_MARGIN), because it leaves windows behind or must rebuild them. Keeping the parts apart matters:
a step that drafts none may still verify the drafts of the step before, so a whole-step time filed under
its own choice would make not drafting look dear. Only decode steps teach the MTP and rest parts (a
prompt's chunk writes many window rows and costs what its prompt costs).
vLLM's static ``disable_by_batch_size`` is honoured on top: no drafts while that many requests run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar

EMA = 0.3  # weight of a new measurement
PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft was verified
RETRY_EVERY = 32  # steps between tries of the runner-up
SWITCH_MARGIN = 0.05  # how much faster the other kind of step must look before the choice changes kind
K = TypeVar("K")


@dataclass(frozen=True)
class StepCost:
    """One step of a speculative engine, timed: its trunk forward over ``tokens`` tokens, the MTP work of
    ``drafts`` drafts for each of ``drafting`` requests while ``requests`` requests ran, and the whole step.
    ``plain``: a plain step (no drafter); ``decode_only``: no request computed a prompt's chunk."""

    seconds: float
    trunk_seconds: float
    draft_seconds: float
    tokens: int
    requests: int
    drafts: int
    drafting: int = 0
    plain: bool = False
    decode_only: bool = True


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
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (c, drafting bucket) -> s
    other_seconds: dict[tuple[bool, int], float] = field(default_factory=dict)  # (plain, bucket) -> s
    acceptance: list[float] = field(default_factory=list)
    exploring: bool = False  # the last choice is a try, not the best estimate
    _steps: int = 0
    _last: int | None = None  # the last choice that was not a try

    def __post_init__(self) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * self.k

    def choose(self, num_running: int, num_ready: int | None = None) -> int:
        """Drafts per request for the next step; 0: a plain step. ``num_ready``: how many of the requests
        can draft now (their windows whole; all of them if None)."""
        self.exploring = False
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or num_running == 0:
            return self.k
        self._steps += 1
        n = num_running
        ready = n if num_ready is None else num_ready
        if ready and (self.k, _request_bucket(ready)) not in self.draft_seconds:
            return self._try(self.k)
        if (True, _request_bucket(n)) not in self.other_seconds:
            return self._try(0)
        if not self.draft_seconds:
            return 0
        rate = self._rates(n, ready or n)  # none ready: whether rebuilding the windows would pay
        ranked = sorted(rate, key=lambda c: -rate[c])
        if len(ranked) > 1 and self._retry_due() and (ready or ranked[1] == 0):
            return self._try(ranked[1])
        best = ranked[0]
        if self._last is not None and (best == 0) != (self._last == 0):
            stay = max((c for c in rate if (c == 0) == (self._last == 0)), key=lambda c: rate[c])
            if rate[best] < (1 + SWITCH_MARGIN) * rate[stay]:
                best = stay
        self._last = best
        return best

    def _try(self, c: int) -> int:
        self.exploring = True
        return c

    def _rates(self, n: int, ready: int) -> dict[int, float]:
        """Tokens per second of each choice, n requests running and ``ready`` of them drafting."""
        rate = {0: n / self.estimate(0, n)}
        for c in range(1, self.k + 1):
            rate[c] = (n + ready * (self.expected_tokens(c) - 1)) / self.estimate(c, n, ready)
        return rate

    def estimate(self, c: int, n: int, ready: int | None = None) -> float:
        """The expected seconds of a step of n requests, ``ready`` (default all) of them drafting c each
        (c = 0: a plain step), in steady state."""
        if c == 0:
            return self._trunk(n) + self._other(True, n)
        r = n if ready is None else ready
        return self._trunk(n + r * c) + self._draft(c, r) + self._other(False, n)

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

    def _draft(self, c: int, r: int) -> float:
        """The MTP work of c drafts for each of r requests: measured for (c, r's size), else scaled from
        the nearest measured c at the nearest measured size, by the number of MTP layer runs and the square
        root of the size ratio."""
        b = _request_bucket(r)
        if (c, b) in self.draft_seconds:
            return self.draft_seconds[(c, b)]
        nb = min({rb for _, rb in self.draft_seconds}, key=lambda x: (abs(x - b), x))
        at = {dc: s for (dc, rb), s in self.draft_seconds.items() if rb == nb}
        near = min(at, key=lambda d: abs(d - c))
        return at[near] * c / near * 2 ** ((b - nb) / 2)

    def _other(self, plain: bool, n: int) -> float:
        """The rest of a step of that kind at n's size, or the nearest measured (either kind)."""
        b = _request_bucket(n)
        same = {rb: s for (p, rb), s in self.other_seconds.items() if p == plain}
        return _nearest(same or {rb: s for (_, rb), s in self.other_seconds.items()}, b)

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
        _update(self.trunk_seconds, _token_bucket(cost.tokens), cost.trunk_seconds)
        if not cost.decode_only:
            return
        b = _request_bucket(cost.requests)
        if cost.plain:
            _update(self.other_seconds, (True, b), max(cost.seconds - cost.trunk_seconds, 0.0))
        elif cost.drafts and cost.drafting:
            _update(self.draft_seconds, (cost.drafts, _request_bucket(cost.drafting)), cost.draft_seconds)
            rest = cost.seconds - cost.trunk_seconds - cost.draft_seconds
            _update(self.other_seconds, (False, b), max(rest, 0.0))

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
