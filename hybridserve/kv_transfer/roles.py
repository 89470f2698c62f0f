"""The engine's side of prefill/decode disaggregation: which requests hand off, and imported ones.

Prefill role: a request marked ``remote_decode`` leaves the scheduler after its first token (unless that
token already finishes it) and its blocks wait in the KvSender for a decode worker to pull them.
Decode role: a request that arrives with a ``remote_prefill`` emits its first token at once, waits
for blocks in every group (all or nothing, FIFO, the queue bounded by the handoff timeout), pulls
the prefill worker's blocks into them, and then decodes like any running request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.config import DisaggregationConfig
from hybridserve.engine.core.scheduler import Scheduler
from hybridserve.engine.request import Request
from hybridserve.kv_transfer.records import HandoffStats, KvHandoff
from hybridserve.kv_transfer.transfer_group import PlanFingerprint
from hybridserve.kv_transfer.transport import KvReceiver, KvSender


class PrefillRole:
    def __init__(self, sender: KvSender, scheduler: Scheduler) -> None:
        self.sender = sender
        self.scheduler = scheduler

    def hand_off(self, req: Request) -> KvHandoff:
        """Take ``req`` (its first token sampled) out of the scheduler; its blocks wait for a pull."""
        self.scheduler.detach(req)
        handoff = self.sender.hold(req.request_id, req.num_computed_tokens)
        if req.generator is not None:
            handoff.seed = req.params.seed
            handoff.offset = len(req.output_token_ids) if not req.params.greedy else 0
            handoff.generator_state = req.generator.get_state().numpy().tobytes()
        return handoff

    def release(self, request_id: str) -> bool:
        return self.sender.release(request_id)

    @property
    def events(self) -> int:
        return self.sender.stats.events

    @property
    def stats(self) -> HandoffStats:
        return self.sender.stats

    @property
    def busy(self) -> bool:
        return self.sender.busy

    def poll(self) -> list[tuple[str, str]]:
        self.sender.poll()
        return []


@dataclass
class _Waiting:
    request: Request
    deadline: float


class DecodeRole:
    def __init__(
        self,
        receiver: KvReceiver,
        scheduler: Scheduler,
        coordinator: KvCacheCoordinator,
        max_num_seqs: int,
    ) -> None:
        self.receiver = receiver
        self.scheduler = scheduler
        self.coordinator = coordinator
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[_Waiting] = deque()
        self.importing: dict[str, Request] = {}
        self._next_renewal = 0.0

    def add(self, req: Request) -> None:
        """Queue an imported request (its first token already in ``output_token_ids``)."""
        remote = req.remote_prefill
        assert remote is not None and remote.handoff is not None
        state = remote.handoff.generator_state
        if req.generator is not None and state is not None:
            req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self.waiting.append(_Waiting(req, time.monotonic() + self.receiver.timeout_s))

    def cancel(self, request_id: str) -> None:
        self.receiver.cancel(request_id)
        self.importing.pop(request_id, None)
        queued = next((w for w in self.waiting if w.request.request_id == request_id), None)
        if queued is not None:  # never pulled: the prefill worker may free its blocks now
            self.waiting.remove(queued)
            self.receiver.release([_handoff(queued.request)])

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.importing)

    @property
    def events(self) -> int:
        return self.receiver.stats.events

    @property
    def stats(self) -> HandoffStats:
        return self.receiver.stats

    def poll(self) -> list[tuple[str, str]]:
        """Start what fits, finish what arrived; -> (request id, why) of imports that failed."""
        failed = self._start_waiting()
        for request_id, error in self.receiver.poll():
            req = self.importing.pop(request_id, None)
            seconds = self.receiver.seconds.pop(request_id, None)
            if req is None:
                continue
            if error is not None:
                failed.append((request_id, error))
                continue
            req.num_computed_tokens = req.remote_prefill.handoff.num_tokens  # type: ignore[union-attr]
            req.kv_handoff_seconds = seconds
            self.coordinator.publish(request_id, req.all_token_ids, req.num_computed_tokens)
            self.scheduler.attach(req)
        return failed

    def _renew_waiting(self, now: float) -> None:
        """The prefill workers' leases on queued requests' blocks outlive this queue's own deadline."""
        if not self.waiting or now < self._next_renewal:
            return
        self._next_renewal = now + self.receiver.timeout_s / 4
        self.receiver.renew([_handoff(w.request) for w in self.waiting])

    def _start_waiting(self) -> list[tuple[str, str]]:
        failed: list[tuple[str, str]] = []
        now = time.monotonic()
        self._renew_waiting(now)
        while self.waiting:
            req = self.waiting[0].request
            if not self._allocate(req):
                if self.waiting[0].deadline >= now:
                    break  # under memory pressure the queue waits, in order
                self.waiting.popleft()
                self.receiver.release([_handoff(req)])
                failed.append((req.request_id, self._starved(req)))
                continue
            self.waiting.popleft()
            handoff = req.remote_prefill.handoff  # type: ignore[union-attr]
            assert handoff is not None
            try:
                self.receiver.start(req.request_id, handoff)
            except Exception as exc:  # unreachable or refused prefill worker: this request fails
                failed.append((req.request_id, f"{type(exc).__name__}: {exc}"))
                continue
            self.importing[req.request_id] = req
        return failed

    def _allocate(self, req: Request) -> bool:
        if len(self.scheduler.running) + len(self.importing) >= self.max_num_seqs:
            return False
        n = req.remote_prefill.handoff.num_tokens  # type: ignore[union-attr]
        if self.coordinator.allocate(req.request_id, n, n + 1):
            return True
        self.coordinator.release(req.request_id)  # a failed allocation leaves an empty table behind
        return False

    def _starved(self, req: Request) -> str:
        return (
            f"no room in the KV cache for request {req.request_id} within {self.receiver.timeout_s:.0f} s "
            f"(raise --kv-cache-memory on the decode worker or --kv-transfer-timeout)"
        )


def _handoff(req: Request) -> KvHandoff:
    assert req.remote_prefill is not None and req.remote_prefill.handoff is not None
    return req.remote_prefill.handoff


Role = PrefillRole | DecodeRole


def build_role(
    config: DisaggregationConfig,
    coordinator: KvCacheCoordinator,
    scheduler: Scheduler,
    fingerprint: Callable[[], PlanFingerprint],
    device: torch.device,
) -> Role | None:
    """This engine's side of a disaggregated deployment, if it is one."""
    host, port, timeout_s = config.bootstrap_host, config.bootstrap_port, config.kv_transfer_timeout
    if config.mode is None:
        return None
    if config.mode == "prefill":
        return PrefillRole(KvSender(coordinator, fingerprint(), device, host, port, timeout_s), scheduler)
    if config.mode == "decode":
        receiver = KvReceiver(coordinator, fingerprint(), device, timeout_s)
        return DecodeRole(receiver, scheduler, coordinator, scheduler.max_num_seqs)
    raise ValueError(f"unknown disaggregation mode {config.mode!r}; choose prefill or decode")
