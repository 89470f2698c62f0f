"""How many tokens to draft under the current load: speculation must never make a busy engine slower.

Drafting pays when the accepted tokens are worth more than the extra work of verifying and drafting;
under load (many running requests, a compute-bound step) it can cost more than it gains, and where the
balance lies depends on the device, the model, the graphs and the text. So it is measured, not assumed.
The controller picks one of two kinds of step:

* drafting c >= 1 tokens per request (those whose MTP windows are whole, ``ready``): a speculative step;
* 0, a plain step: the trunk forward and the plain sampler, nothing of the drafter. It leaves the MTP
  layer's window rows of its positions unwritten, so a request drafts again only once a window's worth of
  rows has been written after them (engine/spec_decode/decoder.py).

A step's time has three parts, each learned from the steps that ran it (``StepCost``) as the least of
its last SAMPLES timings (``Timings``):

* the trunk forward over T tokens (verification included), per quarter octave of T;
* the MTP work of c drafts per request, per (c, octave of the drafting requests r);
* the rest (sampling, scheduling, commit), per (kind of step, octave of the running requests n).

With n requests of which r draft c tokens each, a step verifies n + r c tokens and yields n + r (E(c) - 1)
of them, E(c) = 1 + a_1 + a_1 a_2 + ... (a_i the acceptance at position i: its first verifications are
averaged with the prior, the shallower position's acceptance until then, later ones move an average over
about the last ACCEPTANCE_MEMORY verifications: at 16 requests one step's luck must not decide); a plain
step yields n. The controller picks the choice with the most tokens per second. Parts never measured
(a load not seen yet) are scaled from the nearest measured ones. Drafting k (once some request can) and a
plain step are each tried first; then the runner-up (the best other choice: the first-ranked itself where
SWITCH_MARGIN kept it out, else it would never be measured again) is tried again FIRST_RETRY steps
later, and after twice as many steps each time (MAX_RETRY_GAP at most; back to FIRST_RETRY once the
choice changes kind),
but never so often that its tries cost more than about RETRY_BUDGET of the engine's time (a try's steps
counted at their own length: a runner-up of the other kind, 30% slower, its steps as long, waits 90), so
estimates follow the load while a clear loser costs little. A try lasts until TIMED_PER_TRY steady steps
of its kind were timed (one slow step, another process's doing, must not condemn a choice for a hundred
steps): only decode steps teach the parts (a step drafting none only its trunk), and not the first
SETTLE after a change of kind (plain, drafting c, or none; the first verifies the
last step's drafts, or has none to verify; on a CPU the trunk ran 50% then 25% slower for the two plain
steps after drafting, on caches the MTP work had filled), nor a prompt's chunk (it writes many window rows
and costs what its prompt costs). A plain step that is a try writes the window rows after it is timed, so
trying costs no drafting later; switching between plain and drafting as the choice takes a margin
(SWITCH_MARGIN), because it leaves windows behind or must rebuild them. Keeping the parts apart matters: a
step that drafts none may still verify the drafts of the step before, so a whole-step time filed under its
own choice would make not drafting look dear. A step's time runs from the start of ``EngineCore.step``
(scheduling included) to its outputs.
vLLM's static ``disable_by_batch_size`` is honoured on top: no drafts while that many requests run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

SAMPLES = 6  # timings kept of each part at each size
ACCEPTANCE_MEMORY = 64  # an acceptance estimate averages about this many of the latest verifications
PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft was verified
PRIOR_WEIGHT = 2  # ... worth that many verifications: the first ones average, later ones a running average
FIRST_RETRY = 4  # steps at a load before the runner-up is tried again; the gap doubles after each try
MAX_RETRY_GAP = 1024
RETRY_BUDGET = 0.02  # at most about this share of the speed is lost to tries of a slower runner-up
SETTLE = 2  # steps of a kind after a change of kind that are not timed (caches refill, drafts drain)
SWITCH_MARGIN = 0.05  # how much faster the other kind of step must look before the choice changes kind
TIMED_PER_TRY = 2  # steady steps a try times
TRY_STEPS = 6  # steps a try may take: a step verifying the last drafts, SETTLE steps, the timed ones
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


@dataclass
class Timings:
    """The last SAMPLES timings of one step part at one size; its estimate is the least of them. On a
    shared machine other work only ever makes a step slower, so the low end is the part's own cost; an
    average would carry a burst of slow steps for many (a low quantile too, where the other kind's timings
    come two a try). SAMPLES steps of the running kind, or its last three tries, follow a real change."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    @property
    def seconds(self) -> float:
        return min(self.samples)


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
    trunk_seconds: dict[int, Timings] = field(default_factory=dict)  # token bucket -> s
    draft_seconds: dict[tuple[int, int], Timings] = field(default_factory=dict)  # (c, drafting bucket) -> s
    other_seconds: dict[tuple[bool, int], Timings] = field(default_factory=dict)  # (plain, bucket) -> s
    acceptance: list[float] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)  # verifications seen at each draft position
    exploring: bool = False  # the last choice is a try, not the best estimate
    _steps: int = 0
    _retry_from: dict[int, int] = field(default_factory=dict)  # request bucket -> step of its last try
    _retry_gap: dict[int, int] = field(default_factory=dict)  # request bucket -> steps between its tries
    _last: int | None = None  # the last choice that was not a try
    _trying: tuple[int, int] | None = None  # (choice, steps left) of the try under way
    _prev_kind: str = ""  # the kind of the last step recorded ("plain", "drafting c" or "")
    _run: int = 0  # steps of that kind in a row
    _timed: int = 0  # steady steps of its kind the try under way has timed

    def __post_init__(self) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * self.k
        self.verified = [0] * self.k

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
        if self._trying is not None:
            c, left = self._trying
            if self._timed < TIMED_PER_TRY and left > 0 and (c == 0 or ready):
                self._trying = (c, left - 1)
                self.exploring = True
                return c
            self._trying = None
        if ready and not self.draft_seconds:
            return self._try(self.k, n)
        if not any(plain for plain, _ in self.other_seconds):
            return self._try(0, n)
        if not self.draft_seconds:
            return 0
        seconds = self._seconds(n, ready or n)  # none ready: whether rebuilding the windows would pay
        rate = {c: self._tokens(c, n, ready or n) / s for c, s in seconds.items()}
        ranked = sorted(rate, key=lambda c: -rate[c])  # k >= 1: at least plain and drafting 1
        b = _request_bucket(n)
        best = ranked[0]
        if self._last is not None and (best == 0) != (self._last == 0):
            stay = max((c for c in rate if (c == 0) == (self._last == 0)), key=lambda c: rate[c])
            if rate[best] < (1 + SWITCH_MARGIN) * rate[stay]:
                best = stay
            else:
                self._retry_gap[b] = FIRST_RETRY
        # The runner-up is the best other choice, the first-ranked itself where the margin kept it out.
        rival = ranked[0] if ranked[0] != best else ranked[1]
        # A try's cost in steps of the best choice: its share of speed lost, over its steps (its settling
        # steps too, and the drafts left to verify for the other kind), each as long as a step of its own.
        steps = TRY_STEPS if (best == 0) != (rival == 0) else SETTLE + TIMED_PER_TRY
        loss = max(1 - rate[rival] / rate[best], 0.0) * steps * seconds[rival] / seconds[best]
        if self._retry_due(b, loss) and (ready or rival == 0):
            return self._try(rival, n)
        self._last = best
        return best

    def _try(self, c: int, n: int) -> int:
        """A try lasts until TIMED_PER_TRY steady steps of its kind were timed (after SETTLE steps of it:
        the first verifies the last drafts, or none, on caches the other kind filled), TRY_STEPS at most.
        The next retry at this load counts its steps from here."""
        self.exploring, self._trying, self._timed = True, (c, TRY_STEPS - 1), 0
        self._retry_from[_request_bucket(n)] = self._steps
        return c

    def _seconds(self, n: int, ready: int) -> dict[int, float]:
        """The expected seconds of a step of each choice, n requests running and ``ready`` of them
        drafting."""
        return {c: self.estimate(c, n, ready) for c in range(self.k + 1)}

    def _tokens(self, c: int, n: int, ready: int) -> float:
        """The tokens a step of choice c yields."""
        return n + ready * (self.expected_tokens(c) - 1) if c else n

    def estimate(self, c: int, n: int, ready: int | None = None) -> float:
        """The expected seconds of a step of n requests, ``ready`` (default all) of them drafting c each
        (c = 0: a plain step), in steady state."""
        if c == 0:
            return self._trunk(n) + self._other(True, n)
        r = n if ready is None else ready
        return self._trunk(n + r * c) + self._draft(c, r) + self._other(False, n)

    def _retry_due(self, bucket: int, loss: float) -> bool:
        """Whether the runner-up is due a try at this load, ``loss`` the steps' worth a try of it costs:
        after the gap (doubling with each try) and after enough steps that its tries cost about
        RETRY_BUDGET."""
        gap = self._retry_gap.setdefault(bucket, FIRST_RETRY)
        last = self._retry_from.setdefault(bucket, self._steps)
        if self._steps - last < max(gap, loss / RETRY_BUDGET):
            return False
        self._retry_gap[bucket] = min(2 * gap, MAX_RETRY_GAP)
        return True

    def _trunk(self, tokens: int) -> float:
        """Measured at that size, or scaled from the nearest measured size by the square root of the ratio
        (between a flat, launch-bound step and a linear, compute-bound one; a size that is then chosen
        gets measured)."""
        b = _token_bucket(tokens)
        near = min(self.trunk_seconds, key=lambda t: (abs(t - b), t))
        return self.trunk_seconds[near].seconds * 2 ** ((b - near) / 8)

    def _draft(self, c: int, r: int) -> float:
        """The MTP work of c drafts for each of r requests: measured for (c, r's size), else scaled from
        the nearest measured c at the nearest measured size, by the number of MTP layer runs and the square
        root of the size ratio."""
        b = _request_bucket(r)
        if (c, b) in self.draft_seconds:
            return self.draft_seconds[(c, b)].seconds
        nb = min({rb for _, rb in self.draft_seconds}, key=lambda x: (abs(x - b), x))
        at = {dc: t.seconds for (dc, rb), t in self.draft_seconds.items() if rb == nb}
        near = min(at, key=lambda d: abs(d - c))
        return at[near] * c / near * 2 ** ((b - nb) / 2)

    def _other(self, plain: bool, n: int) -> float:
        """The rest of a step of that kind at n's size, or the nearest measured (either kind)."""
        b = _request_bucket(n)
        same = {rb: t.seconds for (p, rb), t in self.other_seconds.items() if p == plain}
        return _nearest(same or {rb: t.seconds for (_, rb), t in self.other_seconds.items()}, b)

    def expected_tokens(self, c: int) -> float:
        """Tokens one request gains from a step verifying ``c`` drafts."""
        total, reach = 1.0, 1.0
        for i in range(c):
            reach *= self._acceptance(i)
            total += reach
        return total

    def _acceptance(self, i: int) -> float:
        """Position i's acceptance; until one of its drafts is verified, the shallower position's."""
        while i and not self.verified[i]:
            i -= 1
        return self.acceptance[i]

    def record_step(self, cost: StepCost) -> None:
        """A step's timed parts (see the module docstring). The MTP and rest parts are learned from steady
        steps only: a decode step of the same kind as the step before it."""
        if cost.seconds <= 0 or cost.tokens <= 0:
            return
        kind = "plain" if cost.plain else f"drafting {cost.drafts}" if cost.drafts and cost.drafting else ""
        self._run = self._run + 1 if kind == self._prev_kind else 1
        self._prev_kind = kind
        if self._run <= SETTLE or not cost.decode_only:
            return  # settling: its trunk too ran on caches the other kind filled (or a prompt's chunk)
        _update(self.trunk_seconds, _token_bucket(cost.tokens), cost.trunk_seconds)
        if not kind:
            return  # drafts none but may verify some: only its trunk is a step part of a choice
        b = _request_bucket(cost.requests)
        if self._trying is not None and self._trying[0] == (0 if cost.plain else cost.drafts):
            self._timed += 1
        if cost.plain:
            _update(self.other_seconds, (True, b), max(cost.seconds - cost.trunk_seconds, 0.0))
        else:
            _update(self.draft_seconds, (cost.drafts, _request_bucket(cost.drafting)), cost.draft_seconds)
            rest = cost.seconds - cost.trunk_seconds - cost.draft_seconds
            _update(self.other_seconds, (False, b), max(rest, 0.0))

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: drafts 0..num_accepted-1 accepted, the next one (if any) not. A
        position never verified before starts from the one before it (a deeper draft is assumed as good
        as the shallower one until seen otherwise)."""
        for i in range(min(num_accepted + 1, num_drafts)):
            hit = 1.0 if i < num_accepted else 0.0
            if i and not self.verified[i]:
                self.acceptance[i] = self._acceptance(i)
            self.verified[i] += 1
            weight = 1 / min(self.verified[i] + PRIOR_WEIGHT, ACCEPTANCE_MEMORY)
            self.acceptance[i] += weight * (hit - self.acceptance[i])


def _update(table: dict[K, Timings], key: K, seconds: float) -> None:
    table.setdefault(key, Timings()).add(seconds)


def _nearest(table: dict[int, float], key: int) -> float:
    return table[min(table, key=lambda k: (abs(k - key), k))]
