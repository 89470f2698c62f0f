"""Continuous batching: a token budget per step, chunked prefill, decodes first, preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.cache.coordinator import KvCacheCoordinator, PrefixHit
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.config import SchedulerConfig
from hybridserve.engine.core.stop import StopChecker
from hybridserve.engine.request import FinishReason, Logprob, Request, RequestStatus
from hybridserve.engine.sample.ops import SampleResult


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_tokens: int  # including the drafts
    num_spec: int = 0  # the last num_spec tokens are the request's drafts, verified this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens (a new token follows)."""
        return self.end - self.num_spec == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the drafts being verified."""
        known = self.request.all_token_ids[self.start : self.end - self.num_spec]
        return known + self.request.spec_token_ids[: self.num_spec] if self.num_spec else known


@dataclass
class TokenUpdate:
    """What one step appended to a request: its tokens, their logprobs, and why it ends (if it does)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    deferred: list[Request] = field(default_factory=list)  # running prefills held back by the growth reserve

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class _GrowthReserve:
    """Free blocks per group kept for ``requests`` (older running ones) to compute their next tokens.

    ``growth(req)`` is one request's need; the exact sum is taken only when the cheap bound,
    ``per_request`` blocks in every group for each request, is not already left free.
    """

    def __init__(
        self,
        pools: BlockPoolSet,
        requests: list[Request],
        growth: Callable[[Request], dict[str, int]],
        per_request: int,
    ) -> None:
        self.pools, self.requests, self.growth, self.per_request = pools, list(requests), growth, per_request
        self._exact: dict[str, int] | None = None

    def add(self, req: Request) -> None:
        self.requests.append(req)
        if self._exact is not None:
            self._accumulate(self._exact, req)

    def leaves(self, cost: dict[str, int]) -> bool:
        """True if taking ``cost`` blocks per group still leaves the reserve free."""
        bound = len(self.requests) * self.per_request
        if self.pools.can_allocate({name: c + bound for name, c in cost.items()}):
            return True
        if self._exact is None:
            self._exact = {}
            for req in self.requests:
                self._accumulate(self._exact, req)
        exact = self._exact
        return self.pools.can_allocate({name: c + exact.get(name, 0) for name, c in cost.items()})

    def _accumulate(self, total: dict[str, int], req: Request) -> None:
        for name, n in self.growth(req).items():
            total[name] = total.get(name, 0) + n


class Scheduler:
    """Each step: every running decode (one token each), then prefill chunks up to the token budget.

    When a request cannot get its blocks, a prefill chunk first shrinks; otherwise the newest running
    request is preempted (its blocks freed, recomputed later, prefix cache permitting for free).

    Growth reserve: a new admission, or a prefill chunk of a running request, takes blocks only if every
    group is left with enough free blocks (evictable cached ones included) for each *older* running
    request to compute its next ``reserve_lookahead`` tokens (default one block; fewer when its
    ``max_tokens`` ends sooner). Without it, admissions take the blocks that running decodes need on
    the next steps, and those decodes then preempt the newest request: admission thrash. Decodes never
    wait for the reserve; a prefill chunk that does not fit it waits (and admissions stop for the step).
    Only older requests are protected, so the oldest running request never waits and a request that
    fits the pool alone always runs. ``reserve_lookahead=0`` turns the reserve off.
    """

    def __init__(
        self, coordinator: KvCacheCoordinator, config: SchedulerConfig, stop: StopChecker | None = None
    ) -> None:
        self.coordinator = coordinator
        self.max_num_seqs = config.max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.stop = stop or StopChecker(None, coordinator.plan.max_request_tokens())
        # Tokens of growth kept free per older running request (see the class docstring).
        lookahead = config.reserve_lookahead
        self.reserve_lookahead = coordinator.block_tokens if lookahead is None else lookahead
        if self.reserve_lookahead < 0:
            raise ValueError("reserve_lookahead must be >= 0")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompts admitted for the first time
        self.prefix_hit_tokens = 0  # of which found in the prefix cache

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def append_tokens(self, req: Request, results: list[SampleResult]) -> TokenUpdate:
        """Append a step's sampled (or verified) tokens to ``req`` up to the first that ends it: EOS, a
        stop token, its grammar's end, its length."""
        update = TokenUpdate()
        for res in results:
            req.output_token_ids.append(res.token_id)
            update.tokens.append(res.token_id)
            if res.top is not None:
                update.logprobs.append(res.top)
            update.reason, update.stop_reason = self.stop.check(req, res.token_id)
            if update.reason is not None:
                break
        return update

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        with self.coordinator.pools.zeroing_batched():  # new blocks zeroed once for the whole step
            return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chosen: dict[str, ScheduledRequest] = {}
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.arrival_time))
        used = 0  # tokens of ``chosen``, recounted after a preemption drops some
        for req in order:
            budget = self.budget - used
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            preempted = len(out.preempted)
            scheduled = self._schedule_running(req, budget, chosen, out)
            if len(out.preempted) != preempted:
                used = sum(s.num_tokens for s in chosen.values())
            if scheduled is not None:
                chosen[req.request_id] = scheduled
                used += scheduled.num_tokens
        if not out.preempted and not out.deferred:
            self._admit_waiting(self.budget - used, chosen)
        out.scheduled = list(chosen.values())
        return out

    def _schedule_running(
        self, req: Request, budget: int, chosen: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> ScheduledRequest | None:
        start = req.num_computed_tokens
        prefill = req.num_tokens - start > 1
        n = min(req.num_tokens - start + (0 if prefill else len(req.spec_token_ids)), budget)
        older = self.running[: self.running.index(req)] if prefill and self.reserve_lookahead else []
        if older:  # a prefill chunk leaves older running requests room to grow
            fit = self._allocate(req, start, n, self._reserve(older, chosen))
            if not fit:
                out.deferred.append(req)
                return None
            return ScheduledRequest(req, start, fit)
        while True:
            fit = self._allocate(req, start, n)
            if fit:  # a decode that does not fit with all its drafts verifies fewer
                return ScheduledRequest(req, start, fit, 0 if prefill else fit - 1)
            victim = self.running[-1]
            self._preempt(victim, chosen, out)
            if victim is req:
                return None

    def _allocate(self, req: Request, start: int, n: int, reserve: _GrowthReserve | None = None) -> int:
        """Allocate for up to ``n`` tokens, halving a prefill chunk that does not fit; 0 on failure.

        With ``reserve``, a chunk fits only if every group still has the reserve free after it.
        """
        rid = req.request_id
        while n >= 1:
            end = start + n
            fits = reserve is None or reserve.leaves(self.coordinator.extension_cost(rid, start, end))
            if fits and self.coordinator.allocate(rid, start, end):
                return n
            n //= 2
        return 0

    def _reserve(self, requests: list[Request], chosen: dict[str, ScheduledRequest]) -> _GrowthReserve:
        """The blocks ``requests`` need to compute their next ``reserve_lookahead`` tokens."""
        per_request = -(-self.reserve_lookahead // self.coordinator.block_tokens)  # a bound on _growth
        return _GrowthReserve(
            self.coordinator.pools, requests, lambda r: self._growth(r, chosen), per_request
        )

    def _growth(self, req: Request, chosen: dict[str, ScheduledRequest]) -> dict[str, int]:
        """Most blocks per group ``req`` takes beyond what it holds while decoding its next tokens.

        It holds blocks up to the end of its chunk this step (or of what it computed). Decoding token p
        needs p's block and recycles window blocks before p's window, so the peak over the lookahead is
        at its first token or where a new block starts; history groups only grow.
        """
        scheduled = chosen.get(req.request_id)
        start = scheduled.end if scheduled is not None else req.num_computed_tokens
        stop = start + self.reserve_lookahead
        if req.max_tokens:  # the last sampled token is never computed
            stop = min(stop, len(req.prompt_token_ids) + req.max_tokens - 1)
        if stop <= start:
            return {}
        block = self.coordinator.block_tokens
        peak: dict[str, int] = {}
        for p in [start, *range((start // block + 1) * block, stop, block)]:
            for name, n in self.coordinator.extension_cost(req.request_id, p, p + 1).items():
                peak[name] = max(peak.get(name, 0), n)
        return peak

    def _preempt(self, req: Request, chosen: dict[str, ScheduledRequest], out: SchedulerOutput) -> None:
        self.running.remove(req)
        chosen.pop(req.request_id, None)
        self.coordinator.release(req.request_id)
        req.drop_drafts()
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _admit_waiting(self, budget: int, chosen: dict[str, ScheduledRequest]) -> None:
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return
        reserve = self._reserve(self.running, chosen) if self.reserve_lookahead else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.coordinator.has_request(req.request_id):
                # Prompt logprobs need every prompt position computed, so such requests skip the cache.
                wants_all = req.params.prompt_logprobs is not None
                hit = PrefixHit() if wants_all else self.coordinator.probe(req.all_token_ids)
                if hit.num_tokens:
                    self.coordinator.admit_prefix(req.request_id, hit, req.all_token_ids)
                req.num_computed_tokens = hit.num_tokens
                if req.num_preemptions == 0:  # usage reports what the first admission found cached
                    req.num_cached_tokens = hit.num_tokens
            start = req.num_computed_tokens
            n = self._allocate(req, start, min(req.num_tokens - start, budget), reserve)
            if not n:
                self.coordinator.release(req.request_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                self.prompt_tokens += len(req.prompt_token_ids)
                self.prefix_hit_tokens += req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen[req.request_id] = ScheduledRequest(req, start, n)
            budget -= n
            if reserve is not None:
                reserve.add(req)

    def detach(self, req: Request) -> None:
        """Drop a running request but keep its blocks: a KV handoff takes them over."""
        self.running.remove(req)

    def attach(self, req: Request) -> None:
        """Run a request whose blocks were filled elsewhere (a KV handoff) from its computed tokens."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and return its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.coordinator.release(req.request_id)
