"""Continuous batching: a token budget per step, chunked prefill, decodes first, preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens (a new token follows)."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Each step: every running decode (one token each), then prefill chunks up to the token budget.

    When a request cannot get its blocks, a prefill chunk first shrinks; otherwise the newest running
    request is preempted (its blocks freed, recomputed later, prefix cache permitting for free).
    """

    def __init__(
        self, coordinator: KvCacheCoordinator, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.coordinator = coordinator
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompts admitted for the first time
        self.prefix_hit_tokens = 0  # of which found in the prefix cache

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        chosen: dict[str, ScheduledRequest] = {}
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.arrival_time))
        for req in order:
            budget = self.budget - sum(s.num_tokens for s in chosen.values())
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            scheduled = self._schedule_running(req, budget, chosen, out)
            if scheduled is not None:
                chosen[req.request_id] = scheduled
        if not out.preempted:
            self._admit_waiting(self.budget - sum(s.num_tokens for s in chosen.values()), chosen)
        out.scheduled = list(chosen.values())
        return out

    def _schedule_running(
        self, req: Request, budget: int, chosen: dict[str, ScheduledRequest], out: SchedulerOutput
    ) -> ScheduledRequest | None:
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget)
        while True:
            fit = self._allocate(req, start, n)
            if fit:
                return ScheduledRequest(req, start, fit)
            victim = self.running[-1]
            self._preempt(victim, chosen, out)
            if victim is req:
                return None

    def _allocate(self, req: Request, start: int, n: int) -> int:
        """Allocate for up to ``n`` tokens, halving a prefill chunk that does not fit; 0 on failure."""
        while n >= 1:
            if self.coordinator.allocate(req.request_id, start, start + n):
                return n
            n //= 2
        return 0

    def _preempt(self, req: Request, chosen: dict[str, ScheduledRequest], out: SchedulerOutput) -> None:
        self.running.remove(req)
        chosen.pop(req.request_id, None)
        self.coordinator.release(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _admit_waiting(self, budget: int, chosen: dict[str, ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.coordinator.has_request(req.request_id):
                hit = self.coordinator.probe(req.all_token_ids)
                if hit.num_tokens:
                    self.coordinator.admit_prefix(req.request_id, hit, req.all_token_ids)
                req.num_computed_tokens = hit.num_tokens
                if req.num_preemptions == 0:  # usage reports what the first admission found cached
                    req.num_cached_tokens = hit.num_tokens
            start = req.num_computed_tokens
            n = self._allocate(req, start, min(req.num_tokens - start, budget))
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

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and return its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.coordinator.release(req.request_id)
