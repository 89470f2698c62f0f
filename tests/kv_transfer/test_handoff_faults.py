"""Faults at both ends of the KV handoff, the ones the chaos soak found.

Prefill end: a send to a dead decode worker fails that pull, never the engine.
Decode end: an import cancelled before its pull was answered still receives (and discards) the blocks
the prefill worker goes on to send, so that send is matched and the pair stays usable; a reply saying
the pair broke fails every import waiting on that peer and drops it, so the next pull connects again;
a failed transfer, which drops its peer too, fails at once the imports still owed a reply over it.
"""

from __future__ import annotations

import multiprocessing
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

import hybridserve.kv_transfer.transport as disagg
from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import CachePlan, build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.kv_transfer.records import KvHandoff
from hybridserve.kv_transfer.transfer_group import PREFILL_RANK, PlanFingerprint
from hybridserve.kv_transfer.transport import KvReceiver, KvSender, Pull, PullReply
from tests.cache.helpers import toy_specs
from tests.kv_transfer.handoff_rows import moved_rows

PAIR_CLOSED = "Application timeout caused pair closure"  # what gloo raised in the chaos soak
TIMEOUT_S = 20.0


def _toy_plan() -> CachePlan:
    return build_plan(toy_specs(), 8, 8, 64, num_blocks=48)


def _fingerprint(plan: CachePlan) -> PlanFingerprint:
    return PlanFingerprint.of(plan, "toy", torch.float32)


def _broken_pair(group: object, buffer: torch.Tensor, peer: int, tag: int) -> object:
    raise RuntimeError(PAIR_CLOSED)


def test_a_send_to_a_dead_decode_worker_fails_only_that_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = build_plan(toy_specs(), 8, 8, 64, num_blocks=12)
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    sender = KvSender(coordinator, _fingerprint(plan), torch.device("cpu"))
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


# ---- decode end over a real gloo pair --------------------------------------------------------------
# Prompt tokens per request. x and broken are cancelled after their pull went out; the pair breaks when
# broken is pulled, while z waits on it; w is pulled after that.
TOKENS = {"x": 13, "y": 20, "broken": 9, "z": 17, "w": 24}


class _ClosedPair:
    """A pair gloo has closed: a send on it raises at once."""

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        raise RuntimeError(PAIR_CLOSED)


class _RecordingSender(KvSender):
    """A prefill worker that records how each of its sends ended, and whose pair breaks as broken is pulled
    (as gloo closes a pair once a send on it timed out)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: dict[str, str | None] = {}  # handle -> None (received) or why its send failed

    def _pull(self, identity: bytes, message: Pull) -> PullReply:
        if message.handle == "broken" and identity in self.groups:
            self.groups[identity] = _ClosedPair()
        return super()._pull(identity, message)

    def _finish_sends(self) -> None:
        for send in self.sending:
            if send.transfer.done():
                failure = send.transfer.waited.exception()
                self.sent[send.handle] = None if failure is None else str(failure)
        super()._finish_sends()


def _prefill(addresses: Any, done: Any, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plan = _toy_plan()
    pools = BlockPoolSet(plan, "cpu")
    coordinator = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    sender = _RecordingSender(coordinator, _fingerprint(plan), torch.device("cpu"), timeout_s=TIMEOUT_S)
    for rid, n in TOKENS.items():
        assert coordinator.allocate(rid, 0, n)
    for t in pools.tensors().values():  # whatever the model wrote
        t.copy_(torch.randn(t.shape).to(t.dtype))
    expected = {rid: moved_rows(pools, coordinator, rid, n) for rid, n in TOKENS.items()}
    for rid, n in TOKENS.items():
        sender.hold(rid, n)
    addresses.put((sender.control, sender.store_address))
    deadline = time.monotonic() + 2 * TIMEOUT_S  # past the pair's timeout: an unmatched send fails by then
    while (not done.is_set() or sender.busy) and time.monotonic() < deadline:
        sender.poll()
        sender.socket.poll(2)  # wait for the next pull (or let a send progress)
    result = {
        "expected": expected,
        "sent": sender.sent,
        "sending": [s.handle for s in sender.sending],
        "held": list(sender.held),
        "expired": sender.stats.expired,
        "pairs": len(sender.groups),
        "all_free": pools.all_free(),
    }
    sender.close()
    torch.save(result, out)


def _poll(receiver: KvReceiver, until: Callable[[dict[str, str | None]], bool]) -> dict[str, str | None]:
    """Poll as the engine loop does until ``until(ended)``; -> request id: None (arrived) or why not."""
    ended: dict[str, str | None] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while not until(ended):
        assert time.monotonic() < deadline, f"the handoff got stuck: {ended}"
        ended.update(receiver.poll())
        for peer in list(receiver.peers.values()):
            peer.socket.poll(2)  # wait for a reply (or let a receive progress)
    return ended


def _decode(control: str, store: str) -> dict[str, Any]:
    """The decode worker's side: the engine's start / cancel / release calls, in the order of the races."""
    plan = _toy_plan()
    pools = BlockPoolSet(plan, "cpu")
    coordinator = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    receiver = KvReceiver(coordinator, _fingerprint(plan), torch.device("cpu"), TIMEOUT_S)

    def start(*rids: str) -> None:
        for rid in rids:
            assert coordinator.allocate(rid, TOKENS[rid], TOKENS[rid] + 1)
            receiver.start(rid, KvHandoff(rid, control, store, TOKENS[rid]))

    def cancel(rid: str) -> None:  # an abort or a client disconnect: the engine frees the blocks at once
        assert receiver.cancel(rid)
        coordinator.release(rid)

    seen: dict[str, Any] = {}
    try:
        start("x", "y")
        cancel("x")  # its pull is out, its reply not read yet: the prefill worker will send it anyway
        first = receiver.peers[control]
        seen |= _poll(receiver, lambda ended: "y" in ended and not receiver._orphans)
        seen["same pair"] = receiver.peers.get(control) is first
        start("broken", "z")
        cancel("broken")  # the reply to its pull is the one that says the pair broke
        seen |= _poll(receiver, lambda ended: "z" in ended)
        seen["dropped"] = control not in receiver.peers
        start("w")
        seen["reconnected"] = receiver.peers[control] is not first
        seen |= _poll(receiver, lambda ended: "w" in ended)
        seen["received"] = {rid: moved_rows(pools, coordinator, rid, TOKENS[rid]) for rid in ("y", "w")}
        for rid in ("y", "z", "w"):
            coordinator.release(rid)
        seen["busy"], seen["all_free"] = receiver.busy, pools.all_free()
    finally:
        receiver.close()
    return seen


@pytest.fixture(scope="module")
def races(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Run both races between a prefill process (spawned, reaped) and a decode worker in this process.

    -> (what the prefill worker saw, what the decode worker saw, the prefill worker's control address)
    """
    ctx = multiprocessing.get_context("spawn")
    addresses, done = ctx.Queue(), ctx.Event()
    out = tmp_path_factory.mktemp("handoff_faults") / "prefill.pt"
    proc = ctx.Process(target=_prefill, args=(addresses, done, str(out)))
    proc.start()
    try:
        control, store = addresses.get(timeout=3 * TIMEOUT_S)  # a spawn imports torch
        seen = _decode(control, store)
        done.set()
        proc.join(3 * TIMEOUT_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return torch.load(out), seen, control


def _assert_arrived(sent: dict[str, Any], seen: dict[str, Any], rid: str) -> None:
    assert seen[rid] is None and sent["sent"][rid] is None
    expected, received = sent["expected"][rid], seen["received"][rid]
    assert expected.keys() == received.keys()
    for key in expected:
        assert torch.equal(expected[key].view(torch.uint8), received[key].view(torch.uint8)), (rid, key)


def test_a_cancelled_imports_send_is_received_and_the_pair_stays_usable(
    races: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    sent, seen, _ = races
    # The prefill worker's send of x met the receive the decode worker posted for it after the cancel;
    # unmatched, it would have failed at the pair's timeout (and gloo would have closed the pair).
    assert sent["sent"].get("x", "never received") is None, sent["sent"]
    assert "x" not in seen  # a cancelled import ends silently
    _assert_arrived(sent, seen, "y")  # over the same pair, and not mixed up with x's blocks
    assert seen["same pair"]
    assert sent["sending"] == [] and sent["held"] == [] and sent["expired"] == 0
    assert sent["all_free"] and seen["all_free"] and not seen["busy"]


def test_a_broken_pair_fails_what_waits_on_it_and_the_next_pull_connects_again(
    races: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    sent, seen, control = races
    # broken's import was cancelled, but its reply still tells that the pair broke: z, waiting on the
    # same pair, fails with why, rather than on a second pull over a pair the prefill worker dropped.
    assert seen["z"] == (
        f"the KV handoff from the prefill worker at {control} failed: sending broken failed: {PAIR_CLOSED}"
    )
    assert "broken" not in seen and "broken" not in sent["sent"] and "z" not in sent["sent"]
    assert seen["dropped"] and seen["reconnected"] and sent["pairs"] == 1  # the old pair is gone on both ends
    _assert_arrived(sent, seen, "w")
    assert sent["held"] == [] and sent["expired"] == 0 and sent["all_free"]  # z's pull freed its blocks


# ---- decode end, replies chosen by the test ---------------------------------------------------------
A, B = "tcp://prefill-a:1", "tcp://prefill-b:1"


class _FakeControl:
    """A decode worker's control socket to one prefill worker: records pulls, yields the replies queued."""

    def __init__(self) -> None:
        self.pulls: dict[str, Pull] = {}
        self.replies: list[bytes] = []
        self.closed = False

    def send(self, data: bytes, flags: int = 0) -> None:
        pull = msgspec.msgpack.decode(data, type=Pull)
        self.pulls[pull.handle] = pull

    def recv(self, flags: int = 0) -> bytes:
        if not self.replies:
            raise zmq.Again()
        return self.replies.pop(0)

    def reply(self, handle: str, ok: bool = True, message: str = "", reconnect: bool = False) -> None:
        self.replies.append(msgspec.msgpack.encode(PullReply(handle, ok, message, reconnect)))

    def close(self, linger: int | None = None) -> None:
        self.closed = True


class _Pending:
    """A posted receive that has not ended (until the test ends it, or fails it with ``error``)."""

    finished = False
    error = ""

    def done(self) -> bool:
        return self.finished or bool(self.error)

    def result(self) -> torch.Tensor:
        raise RuntimeError(self.error)


class _Receiver(KvReceiver):
    """Connects to fake prefill workers; records every receive it posts as (group, tokens, peer, tag)."""

    def __init__(self, coordinator: KvCacheCoordinator, plan: CachePlan) -> None:
        super().__init__(coordinator, _fingerprint(plan), torch.device("cpu"), TIMEOUT_S)
        self.connects: list[str] = []
        self.posted: list[tuple[Any, int, int, int]] = []
        self.transfers: list[weakref.ref[_Pending]] = []

    def _connect(self, handoff: KvHandoff) -> disagg._Peer:
        self.connects.append(handoff.control)
        return disagg._Peer(_FakeControl(), None, f"group {len(self.connects)}")  # type: ignore[arg-type]

    def post_recv(self, group: Any, plan: CachePlan, n: int, peer: int, tag: int, device: Any) -> _Pending:
        assert plan is self.coordinator.plan and device == self.device
        self.posted.append((group, n, peer, tag))
        transfer = _Pending()
        self.transfers.append(weakref.ref(transfer))
        return transfer

    def control(self, address: str) -> _FakeControl:
        return self.peers[address].socket  # type: ignore[return-value]

    def start_all(self, *imports: tuple[str, str, int]) -> None:
        for rid, address, n in imports:
            self.start(rid, KvHandoff(rid, address, "unused:0", n))


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Receiver]:
    plan = _toy_plan()
    coordinator = KvCacheCoordinator(plan, BlockPoolSet(plan, "cpu"), enable_prefix_caching=False)
    r = _Receiver(coordinator, plan)
    monkeypatch.setattr(disagg, "post_recv", r.post_recv)
    yield r
    r.close()


def test_a_cancelled_import_receives_a_granted_pull_once_and_a_refused_one_never(receiver: _Receiver) -> None:
    receiver.start_all(("x", A, 13), ("v", A, 7), ("y", A, 20))
    assert receiver.cancel("x") and receiver.cancel("v")
    a = receiver.control(A)
    a.reply("x")
    a.reply("v", ok=False, message="the prefill worker has no blocks for v: it is unknown")
    a.reply("y")
    assert receiver.poll() == []  # cancelled imports end silently; y's blocks are on their way
    x, y = a.pulls["x"].tag, a.pulls["y"].tag
    assert receiver.posted == [("group 1", 13, PREFILL_RANK, x), ("group 1", 20, PREFILL_RANK, y)]
    assert receiver.peers[A].socket is a and receiver.stats.failed == 0 and receiver.busy
    a.reply("x")  # a repeated or late grant posts nothing more: each cancelled import is drained once
    a.reply("v")
    receiver.poll()
    assert len(receiver.posted) == 2
    orphan = receiver.transfers[0]  # x's receive stays alive until it ends (its buffer is gloo's target)
    pending = orphan()
    assert pending is not None
    pending.finished = True
    del pending
    receiver.poll()
    assert orphan() is None  # ended: let go


@pytest.mark.parametrize("answered_cancelled", [True, False], ids=["answers-a-cancelled-one", "a-live-one"])
def test_a_broken_pair_fails_every_import_on_that_peer_only_and_the_next_pull_reconnects(
    receiver: _Receiver, answered_cancelled: bool
) -> None:
    receiver.start_all(("a1", A, 9), ("a2", A, 11), ("a3", A, 5), ("b1", B, 8), ("b2", B, 12))
    receiver.cancel("a3")  # unanswered on A: forgotten with A's connection
    receiver.cancel("b2")  # unanswered on B: still drained when B grants it
    if answered_cancelled:
        receiver.cancel("a1")
    a, b = receiver.control(A), receiver.control(B)
    a.reply("a1", ok=False, message=f"sending a1 failed: {PAIR_CLOSED}", reconnect=True)
    a.reply("a3")  # never read: it would come over the connection that is gone
    why = f"the KV handoff from the prefill worker at {A} failed: sending a1 failed: {PAIR_CLOSED}"
    failed = ["a2"] if answered_cancelled else ["a1", "a2"]
    assert sorted(receiver.poll()) == [(rid, why) for rid in failed]
    assert a.closed and A not in receiver.peers and receiver.stats.failed == len(failed)
    assert receiver.peers[B].socket is b and not b.closed and set(receiver.imports) == {"b1"}
    assert receiver._unanswered.keys() == {(B, "b2")}
    b.reply("b2")
    b.reply("b1")
    assert receiver.poll() == [] and receiver.posted == [
        ("group 2", 12, PREFILL_RANK, b.pulls["b2"].tag),
        ("group 2", 8, PREFILL_RANK, b.pulls["b1"].tag),
    ]
    receiver.start_all(("a4", A, 6))  # connects again
    assert receiver.connects == [A, B, A] and receiver.control(A) is not a
    assert list(receiver.control(A).pulls) == ["a4"]


def test_a_failed_transfer_fails_what_still_waits_for_a_reply_from_that_peer_at_once(
    receiver: _Receiver,
) -> None:
    receiver.start_all(("a1", A, 9), ("a2", A, 11), ("a3", A, 5), ("b1", B, 8))
    a = receiver.control(A)
    a.reply("a1")
    assert receiver.poll() == []
    transfer = receiver.transfers[0]()
    assert transfer is not None
    transfer.error = PAIR_CLOSED  # the pair broke under a1's receive: A is dropped, its replies unread
    ended = dict(receiver.poll())
    at = f"the KV handoff from the prefill worker at {A} failed:"
    assert ended.pop("a1") == f"{at} the transfer failed: {PAIR_CLOSED}"
    # a2 and a3 cannot get a reply over the closed connection: they fail now, not at their deadline
    assert ended.keys() == {"a2", "a3"} and all(why.startswith(at) for why in ended.values())
    assert A not in receiver.peers and set(receiver.imports) == {"b1"} and receiver.stats.failed == 3
    receiver.start_all(("a4", A, 6))  # the next pull connects again
    assert receiver.connects == [A, B, A] and receiver.cancel("a4") and set(receiver.imports) == {"b1"}
