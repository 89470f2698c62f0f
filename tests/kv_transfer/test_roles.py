"""The decode role's queue: imports allocate in every group all or nothing, wait in order under memory
pressure, start when blocks free up, fail (freeing nothing twice) past the timeout, and cancel cleanly."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.config import SchedulerConfig
from hybridserve.engine.core.scheduler import Scheduler
from hybridserve.engine.request import RemotePrefill, Request, SamplingParams
from hybridserve.kv_transfer.records import KvHandoff
from hybridserve.kv_transfer.roles import DecodeRole
from tests.cache.helpers import toy_specs

BLOCK = 8


@dataclass
class FakeReceiver:
    """Stands in for KvReceiver: records pulls; the test decides when they end."""

    timeout_s: float = 30.0
    started: list[str] = field(default_factory=list)
    ended: list[tuple[str, str | None]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # pull times of the imports that arrived
    renewed: list[list[str]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def renew(self, handoffs: list[KvHandoff]) -> None:
        self.renewed.append([h.handle for h in handoffs])

    def release(self, handoffs: list[KvHandoff]) -> None:
        self.released += [h.handle for h in handoffs]

    def start(self, request_id: str, handoff: KvHandoff) -> None:
        self.started.append(request_id)

    def poll(self) -> list[tuple[str, str | None]]:
        ended, self.ended = self.ended, []
        return ended

    def cancel(self, request_id: str) -> bool:
        return True


def _setup(num_blocks: int, timeout_s: float = 30.0) -> tuple[DecodeRole, FakeReceiver, KvCacheCoordinator]:
    plan = build_plan(toy_specs(), BLOCK, 8, 64, num_blocks=num_blocks)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"))
    receiver = FakeReceiver(timeout_s)
    role = DecodeRole(receiver, Scheduler(coordinator, SchedulerConfig(8, 64)), coordinator, 8)  # type: ignore[arg-type]
    return role, receiver, coordinator


def _imported(rid: str, num_tokens: int) -> Request:
    handoff = KvHandoff(rid, "tcp://127.0.0.1:1", "127.0.0.1:2", num_tokens)
    req = Request(
        rid,
        list(range(num_tokens)),
        SamplingParams(temperature=0),
        remote_prefill=RemotePrefill(5, handoff=handoff),
    )
    req.output_token_ids.append(5)
    return req


def test_imports_wait_in_order_under_memory_pressure_then_run() -> None:
    role, receiver, coordinator = _setup(num_blocks=6)  # 40 tokens of history: one request at a time
    a, b, c = _imported("a", 30), _imported("b", 30), _imported("c", 3)
    for r in (a, b, c):
        role.add(r)
    assert role.poll() == [] and receiver.started == ["a"]  # b does not fit; c waits behind it (FIFO)
    assert not coordinator.has_request("b") and not coordinator.has_request("c")
    receiver.ended.append(("a", None))
    receiver.seconds["a"] = 0.25
    role.poll()
    assert role.scheduler.running == [a] and a.num_computed_tokens == 30
    assert a.kv_handoff_seconds == 0.25 and not receiver.seconds  # the request reports its pull time
    role.scheduler.finish(a)  # a finished decoding: its blocks come back
    role.poll()
    assert receiver.started == ["a", "b", "c"]
    coordinator.pools.check_integrity()


def test_an_import_that_never_fits_fails_past_the_timeout_and_a_cancel_frees_its_blocks() -> None:
    role, receiver, coordinator = _setup(num_blocks=6, timeout_s=0.0)
    role.add(_imported("a", 30))
    role.add(_imported("b", 30))
    failed = role.poll()  # a starts at once; b's deadline (0 s) has passed
    assert [rid for rid, _ in failed] == ["b"] and "--kv-cache-memory" in failed[0][1]
    assert receiver.released == ["b"]  # its prefill worker frees b's blocks now, not at its timeout
    role.cancel("a")
    coordinator.release("a")  # what EngineCore.finish_request does after the cancel
    assert not role.busy and coordinator.pools.all_free()


def test_queued_imports_renew_their_prefill_leases_every_quarter_timeout() -> None:
    """The prefill worker frees unpulled blocks after the timeout; what waits here for room must not
    lose them (the soak's n > 1 choices did, behind a busy decode worker)."""
    role, receiver, _ = _setup(num_blocks=6)
    for rid in ("a", "b", "c"):
        role.add(_imported(rid, 30))
    role.poll()
    assert receiver.renewed == [["a", "b", "c"]]  # renewed before a takes the room (harmless for a)
    role.poll()
    assert len(receiver.renewed) == 1  # not again before a quarter of the timeout has passed
    role._next_renewal -= receiver.timeout_s / 4
    role.poll()
    assert receiver.renewed[-1] == ["b", "c"]  # a is importing: only the queue is renewed


def test_a_request_cancelled_before_its_pull_releases_its_prefill_blocks() -> None:
    """A client that disconnects (or aborts) while its request waits here for room: the prefill worker
    is told to free the blocks at once (the soak saw ~10 a minute wait out the 30 s timeout instead)."""
    role, receiver, coordinator = _setup(num_blocks=6)
    role.add(_imported("a", 30))
    role.add(_imported("b", 30))
    role.poll()  # a pulls; b waits for room
    role.cancel("b")
    role.cancel("a")  # a's pull was sent: the prefill worker already let go of its hold
    assert receiver.released == ["b"] and not role.busy
    coordinator.release("a")
    assert coordinator.pools.all_free()
