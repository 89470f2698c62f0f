"""How many tokens to draft under the current load: speculation must never make a busy engine slower.

Drafting pays when the accepted tokens are worth more than the extra work of verifying and drafting;
under load (many running requests, a compute-bound step) it can cost more than it gains, and where the
balance lies depends on the device, the model and the text. So it is measured, not assumed. Every step
teaches the controller two things: how long a step of T tokens takes (kept per power of two of T,
separately for plain steps and for steps that verify and draft) and, when it drafted, how often the
draft at each position is accepted. For n running requests, drafting c tokens each makes a step of
about n (1 + c) tokens that yields n E(c) tokens, E(c) = 1 + a_1 + a_1 a_2 + ... (a_i the acceptance at
position i); the controller picks the c in 0..k with the most tokens per second. A step size it has
never timed is tried once; now and then (soon after the start, then every RETRY_EVERY steps) the
runner-up is tried again, so estimates follow the load.
vLLM's static ``disable_by_batch_size`` is honoured on top: no drafts while that many requests run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA = 0.3  # weight of a new measurement
PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft was verified
RETRY_EVERY = 32  # steps between tries of the runner-up


@dataclass
class DraftController:
    k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    step_seconds: dict[tuple[bool, int], float] = field(default_factory=dict)  # (drafting, log2 T) -> s
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
        n = num_running
        for drafting, c in ((True, self.k), (False, 0)):  # each kind of step is timed once first
            if not any(key[0] is drafting for key in self.step_seconds):
                return c
        rate = {c: n * self.expected_tokens(c) / self._seconds(c > 0, n * (1 + c)) for c in range(self.k + 1)}
        ranked = sorted(rate, key=lambda c: -rate[c])
        return ranked[1] if self._retry_due() and len(ranked) > 1 else ranked[0]

    def _retry_due(self) -> bool:
        """Steps 4, 8 and 16, then every RETRY_EVERY: a first timing taken during a load spike is
        corrected within a short request, not only after RETRY_EVERY steps."""
        return self._steps in (4, 8, 16) or self._steps % RETRY_EVERY == 0

    def _seconds(self, drafting: bool, num_tokens: int) -> float:
        """The expected time of a step of ``num_tokens``: measured at that size, or scaled from the nearest
        measured size by the square root of the ratio (between a flat, launch-bound step and a linear,
        compute-bound one; a size that is then chosen gets measured)."""
        b = num_tokens.bit_length()
        timed = [key[1] for key in self.step_seconds if key[0] is drafting]
        near = min(timed, key=lambda t: (abs(t - b), t))
        return self.step_seconds[(drafting, near)] * 2 ** ((b - near) / 2)

    def expected_tokens(self, c: int) -> float:
        """Tokens one request gains from a step verifying ``c`` drafts."""
        total, reach = 1.0, 1.0
        for a in self.acceptance[:c]:
            reach *= a
            total += reach
        return total

    def record_step(self, seconds: float, num_tokens: int, drafting: bool) -> None:
        """A step's wall time and the tokens it computed (verified drafts included)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        key = (drafting, num_tokens.bit_length())
        old = self.step_seconds.get(key)
        self.step_seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def record_verified(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: drafts 0..num_accepted-1 accepted, the next one (if any) not."""
        for i in range(min(num_accepted + 1, num_drafts)):
            hit = 1.0 if i < num_accepted else 0.0
            self.acceptance[i] = (1 - EMA / 4) * self.acceptance[i] + EMA / 4 * hit
