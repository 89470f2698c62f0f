"""How many tokens to draft under the current load: speculation must never make a busy engine slower.

Drafting pays when the accepted tokens are worth more than the extra work of verifying and drafting;
under load (many running requests, a compute-bound step) it can cost more than it gains, and where the
balance lies depends on the device, the model and the text. So it is measured, not modelled: the
controller runs each choice (0 = no drafts and no MTP pass, 1..k drafts) for a trial of a few steps,
records output tokens per second per load bucket (running requests, by powers of two), then keeps the
fastest choice for that bucket and re-measures another now and then. vLLM's static
``disable_by_batch_size`` is honoured on top: no drafts while that many requests run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRIAL_STEPS = 8  # steps one measurement covers
EXPLORE_EVERY = 8  # trials between re-measurements of a choice that is not the best


@dataclass
class _Trial:
    bucket: int
    choice: int
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0


@dataclass
class DraftController:
    k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    rates: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, choice) -> tokens/s
    _trial: _Trial | None = None
    _trials: int = 0

    def choose(self, num_running: int) -> int:
        """Drafts per request for the next step (0: no MTP work at all)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k
        bucket = num_running.bit_length()
        trial = self._trial
        if trial is None or trial.bucket != bucket or trial.steps >= TRIAL_STEPS:
            self._finish(trial)
            trial = self._trial = _Trial(bucket, self._next_choice(bucket))
        return trial.choice

    def record(self, seconds: float, tokens: int) -> None:
        """One step's wall time and output tokens, counted for the choice that produced them."""
        if self._trial is not None:
            self._trial.steps += 1
            self._trial.seconds += seconds
            self._trial.tokens += tokens

    def _finish(self, trial: _Trial | None) -> None:
        if trial is None or trial.steps < TRIAL_STEPS or trial.seconds <= 0:
            return
        self._trials += 1
        rate = trial.tokens / trial.seconds
        key = (trial.bucket, trial.choice)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else 0.5 * old + 0.5 * rate

    def _next_choice(self, bucket: int) -> int:
        choices = [self.k, 0, *range(1, self.k)]
        unmeasured = [c for c in choices if (bucket, c) not in self.rates]
        if unmeasured:
            return unmeasured[0]
        ranked = sorted(choices, key=lambda c: -self.rates[(bucket, c)])
        if self._trials % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return (
                ranked[1 + (self._trials // EXPLORE_EVERY) % (len(ranked) - 1)]
                if len(ranked) > 1
                else ranked[0]
            )
        return ranked[0]
