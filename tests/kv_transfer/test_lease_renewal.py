"""The prefill end of a lease: a Renew restarts the timeout of the handles it names (and only theirs), a
Release frees them at once; handles it does not hold are ignored."""

from __future__ import annotations

import time

import msgspec
import torch
import zmq

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.kv_transfer.transfer_group import PlanFingerprint
from hybridserve.kv_transfer.transport import KvSender, Release, Renew
from tests.cache.helpers import toy_specs


def test_a_renew_keeps_the_named_handles_and_the_others_expire() -> None:
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=48)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    sender = KvSender(coordinator, PlanFingerprint.of(plan, "toy", torch.float32), torch.device("cpu"))
    dealer = sender._ctx.socket(zmq.DEALER)
    try:
        for rid in ("kept", "dropped"):
            assert coordinator.allocate(rid, 0, 20)
            sender.hold(rid, 20)
            sender.held[rid].deadline = time.monotonic() - 1  # both past their timeout
        dealer.connect(sender.control)
        dealer.send(msgspec.msgpack.encode(Renew(["kept", "unknown"])))
        assert sender.socket.poll(10_000)
        sender.poll()  # reads the Renew before it expires anything
        assert list(sender.held) == ["kept"] and sender.stats.expired == 1
        assert sender.held["kept"].deadline > time.monotonic() + sender.timeout_s - 5
        assert not coordinator.has_request("dropped") and coordinator.has_request("kept")
    finally:
        dealer.close(linger=0)
        sender.close()


def test_a_release_frees_the_named_handles_at_once() -> None:
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=48)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    sender = KvSender(coordinator, PlanFingerprint.of(plan, "toy", torch.float32), torch.device("cpu"))
    dealer = sender._ctx.socket(zmq.DEALER)
    try:
        for rid in ("gone", "wanted"):
            assert coordinator.allocate(rid, 0, 20)
            sender.hold(rid, 20)
        dealer.connect(sender.control)
        dealer.send(msgspec.msgpack.encode(Release(["gone", "unknown"])))
        assert sender.socket.poll(10_000)
        sender.poll()
        assert list(sender.held) == ["wanted"] and sender.stats.expired == 0
        assert not coordinator.has_request("gone") and coordinator.has_request("wanted")
    finally:
        dealer.close(linger=0)
        sender.close()
