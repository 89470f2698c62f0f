"""The prefill end of a lease: a Renew restarts the timeout of the handles it names (and only theirs), a
Release frees them at once; handles it does not hold are ignored."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.kv_transfer.transfer_group import PlanFingerprint
from hybridserve.kv_transfer.transport import KvSender, Release, Renew
from tests.cache.helpers import toy_specs

HELD = ("a", "b")


@pytest.fixture
def sender() -> Iterator[KvSender]:
    """A prefill end holding requests a and b (20 tokens each)."""
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=48)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    end = KvSender(coordinator, PlanFingerprint.of(plan, "toy", torch.float32), torch.device("cpu"))
    for rid in HELD:
        assert coordinator.allocate(rid, 0, 20)
        end.hold(rid, 20)
    yield end
    end.close()


def _tell(sender: KvSender, message: Renew | Release) -> None:
    """Send ``message`` as a decode worker would, then let the prefill end read it."""
    dealer = sender._ctx.socket(zmq.DEALER)
    try:
        dealer.connect(sender.control)
        dealer.send(msgspec.msgpack.encode(message))
        assert sender.socket.poll(10_000)
        sender.poll()  # reads the message before it expires anything
    finally:
        dealer.close(linger=0)


def test_a_renew_keeps_the_named_handles_and_the_others_expire(sender: KvSender) -> None:
    for rid in HELD:
        sender.held[rid].deadline = time.monotonic() - 1  # both past their timeout
    _tell(sender, Renew(["a", "unknown"]))
    assert list(sender.held) == ["a"] and sender.stats.expired == 1
    assert sender.held["a"].deadline > time.monotonic() + sender.timeout_s - 5
    assert sender.coordinator.has_request("a") and not sender.coordinator.has_request("b")


def test_a_release_frees_the_named_handles_at_once(sender: KvSender) -> None:
    _tell(sender, Release(["a", "unknown"]))
    assert list(sender.held) == ["b"] and sender.stats.expired == 0
    assert not sender.coordinator.has_request("a") and sender.coordinator.has_request("b")
