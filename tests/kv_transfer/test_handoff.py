"""The KV handoff between two gloo processes: every group's blocks arrive byte-exact, a plan mismatch is
refused at connect with a clear error, and the sender keeps no block once it has sent."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import CachePlan, build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.kv_transfer.records import KvHandoff
from hybridserve.kv_transfer.transfer_group import FingerprintMismatch, PlanFingerprint
from hybridserve.kv_transfer.transport import KvReceiver, KvSender
from hybridserve.models.deepseek_v4 import cache_specs
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from hybridserve.models.loader import read_config
from tests.kv_transfer.handoff_rows import moved_rows

# (request id, prompt tokens): odd lengths, shorter than one block, ending on and across block boundaries.
REQUESTS = [("a", 1), ("b", 7), ("c", 12), ("d", 13), ("e", 37), ("f", 24)]
TIMEOUT_S = 20.0


def _plan(folder: str, block_tokens: int) -> CachePlan:
    cfg = DeepseekV4Config.from_dict(read_config(folder))
    return build_plan(cache_specs(cfg, torch.float32), block_tokens, 8, 64, num_blocks=48)


CASES = [("mixed", 8, 8), ("csa_heavy", 12, 12), ("mixed", 8, 16)]  # model, prefill and decode block size


def _prefill(folders: dict[str, str], addresses: Any, done: Any, out: str) -> None:
    torch.manual_seed(0)
    results = [_prefill_case(folders[name], block_tokens, addresses, done) for name, block_tokens, _ in CASES]
    torch.save(results, out)


def _prefill_case(folder: str, block_tokens: int, addresses: Any, done: Any) -> dict[str, Any]:
    plan = _plan(folder, block_tokens)
    pools = BlockPoolSet(plan, "cpu")
    coordinator = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    sender = KvSender(
        coordinator, PlanFingerprint.of(plan, folder, torch.float32), torch.device("cpu"), timeout_s=TIMEOUT_S
    )
    for rid, n in REQUESTS:
        for start in range(0, n, 5):  # chunked prefill: window groups recycle blocks as they go
            assert coordinator.allocate(rid, start, min(n, start + 5))
    for t in pools.tensors().values():  # whatever the model wrote
        t.copy_(torch.randn(t.shape).to(t.dtype))
    expected = {rid: moved_rows(pools, coordinator, rid, n) for rid, n in REQUESTS}
    for rid, n in REQUESTS:
        sender.hold(rid, n)
    addresses.put((sender.control, sender.store_address))
    deadline = time.monotonic() + TIMEOUT_S
    while (sender.held or sender.sending) and not done.wait(0.001) and time.monotonic() < deadline:
        sender.poll()
    sender.poll()
    done.wait(TIMEOUT_S)
    done.clear()
    held = list(sender.held)
    for rid in held:
        sender.release(rid)
    sender.close()
    return {
        "expected": expected,
        "all_free": pools.all_free(),
        "held": held,
        "stats": sender.stats.bytes_by_group,
    }


def _decode(folders: dict[str, str], addresses: Any, done: Any, out: str) -> None:
    results = []
    for name, _, block_tokens in CASES:
        results.append(_decode_case(folders[name], block_tokens, addresses))
        done.set()
        while done.is_set():
            time.sleep(0.001)
    torch.save(results, out)


def _decode_case(folder: str, block_tokens: int, addresses: Any) -> dict[str, Any]:
    plan = _plan(folder, block_tokens)
    pools = BlockPoolSet(plan, "cpu")
    for t in pools.tensors().values():
        t.fill_(7)
    coordinator = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    receiver = KvReceiver(
        coordinator, PlanFingerprint.of(plan, folder, torch.float32), torch.device("cpu"), TIMEOUT_S
    )
    control, store = addresses.get(timeout=TIMEOUT_S)
    result: dict[str, Any] = {"received": {}, "errors": {}}
    try:
        for rid, n in REQUESTS:
            assert coordinator.allocate(rid, n, n + 1)  # all the next decode step needs
            receiver.start(rid, KvHandoff(rid, control, store, n))
    except FingerprintMismatch as exc:
        result["refused"] = str(exc)
    deadline = time.monotonic() + TIMEOUT_S
    while receiver.busy and time.monotonic() < deadline:
        for rid, error in receiver.poll():
            result["errors"][rid] = error
        time.sleep(0.001)
    for rid, n in REQUESTS:
        if rid in result["errors"] and result["errors"][rid] is None:
            result["received"][rid] = moved_rows(pools, coordinator, rid, n)
    receiver.close()
    return result


@pytest.fixture(scope="module")
def pair(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[dict, dict]]:
    """Run every case through one prefill process and one decode process (spawned, reaped)."""
    folders = {name: str(tiny_checkpoint(name)) for name, _, _ in CASES}
    ctx = multiprocessing.get_context("spawn")
    addresses, done = ctx.Queue(), ctx.Event()
    tmp = tmp_path_factory.mktemp("handoff")
    outs = tmp / "prefill.pt", tmp / "decode.pt"
    procs = [
        ctx.Process(target=_prefill, args=(folders, addresses, done, str(outs[0]))),
        ctx.Process(target=_decode, args=(folders, addresses, done, str(outs[1]))),
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S * 4)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        with contextlib.suppress(queue.Empty):
            addresses.get_nowait()
    return list(zip(torch.load(outs[0]), torch.load(outs[1]), strict=True))


@pytest.mark.parametrize("case", [0, 1], ids=["mixed-8", "csa_heavy-12"])
def test_every_groups_blocks_round_trip_byte_exact(pair: list[tuple[dict, dict]], case: int) -> None:
    sent, got = pair[case]
    assert got["errors"] == {rid: None for rid, _ in REQUESTS}
    groups = {key.split("/")[0] for key in sent["expected"]["a"]}
    assert len(groups) == 5  # window KV, CSA state and rows (with indexer keys), HCA state and rows
    for rid, _ in REQUESTS:
        expected, received = sent["expected"][rid], got["received"][rid]
        assert expected.keys() == received.keys()
        for key in expected:
            assert torch.equal(expected[key].view(torch.uint8), received[key].view(torch.uint8)), (rid, key)
    assert sent["all_free"] and not sent["held"], "the prefill side kept blocks after sending them"
    assert set(sent["stats"]) == groups


def test_a_plan_mismatch_is_refused_at_connect(pair: list[tuple[dict, dict]]) -> None:
    sent, got = pair[2]
    assert "block sizes differ (8 vs 16 tokens)" in got["refused"] and "--block-tokens" in got["refused"]
    assert sent["held"] == [rid for rid, _ in REQUESTS]  # nothing was pulled
