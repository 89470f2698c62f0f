"""A prefill worker whose decode peer died: the failed send fails that pull, never the engine."""

from __future__ import annotations

import pytest
import torch

import hybridserve.distributed.disagg as disagg
from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.distributed.disagg import KvSender, Pull
from hybridserve.distributed.kv_transfer_group import PlanFingerprint
from tests.cache.helpers import toy_specs


def _broken_pair(group: object, buffer: torch.Tensor, peer: int, tag: int) -> object:
    raise RuntimeError("Application timeout caused pair closure")  # what gloo raised in the chaos soak


def test_a_send_to_a_dead_decode_worker_fails_only_that_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=12)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    sender = KvSender(coordinator, PlanFingerprint.of(plan, "toy", torch.float32), torch.device("cpu"))
    try:
        for rid in ("a", "b"):
            assert coordinator.allocate(rid, 0, 20)
            sender.hold(rid, 20)
        sender.groups[b"dead"] = object()  # type: ignore[assignment]
        monkeypatch.setattr(disagg, "post_send", _broken_pair)
        reply = sender._pull(b"dead", Pull("a", tag=1, num_tokens=20))
        assert not reply.ok and reply.reconnect and "pair closure" in reply.message
        assert b"dead" not in sender.groups and sender.stats.failed == 1
        again = sender._pull(b"dead", Pull("b", tag=2, num_tokens=20))  # the pair is gone: refused
        assert not again.ok and again.reconnect and "not connected" in again.message
        sender.poll()  # the engine's next step goes on
        assert not sender.busy and coordinator.pools.all_free()  # both requests' blocks are back
    finally:
        sender.close()
