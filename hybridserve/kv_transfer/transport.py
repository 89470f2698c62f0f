"""The two ends of the KV handoff: a prefill worker holds and sends, a decode worker pulls and receives.

Control messages (msgspec over ZMQ: a ROUTER on the prefill worker, a DEALER per prefill peer on the
decode worker) decide what moves; the blocks themselves move with torch.distributed point-to-point over
the pair's process group (see kv_transfer_group). Both ends are polled from their engine core's loop
and never block it, except for the one-time connect of a new pair (bounded by the handoff timeout).

    decode                                   prefill
    Connect(pair id, fingerprint)   ---->    compare; ConnectReply; both build the pair group
    Pull(handle, tag, num_tokens)   ---->    pack the blocks, release them, post the send; PullReply
    post the receive on PullReply ok          (held handles nobody pulls expire after the timeout)
    Renew(handles)                  ---->    the decode worker still queues them (waiting for room):
                                              their timeout starts again
    Release(handles)                ---->    it will never pull them (cancelled before its pull): free
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist
import zmq

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.kv_transfer.handoff import (
    Transfer,
    checksums,
    corrupt_groups,
    handoff_bytes,
    pack,
    post_recv,
    post_send,
    unpack,
)
from hybridserve.kv_transfer.records import HandoffError, HandoffStats, KvHandoff
from hybridserve.kv_transfer.transfer_group import (
    DECODE_RANK,
    PREFILL_RANK,
    FingerprintMismatch,
    PairGroup,
    PlanFingerprint,
    host_store,
    join_store,
    pair_group,
)

log = logging.getLogger("hybridserve.disagg")

_TAG_SPACE = 1 << 30


# ---- control messages ----------------------------------------------------------------------------
class Connect(msgspec.Struct, tag="connect"):
    pair_id: str
    fingerprint: str


class ConnectReply(msgspec.Struct, tag="connected"):
    ok: bool
    message: str = ""
    fingerprint: str = ""


class Pull(msgspec.Struct, tag="pull"):
    handle: str
    tag: int
    num_tokens: int


class Renew(msgspec.Struct, tag="renew"):
    handles: list[str]


class Release(msgspec.Struct, tag="release"):
    handles: list[str]


class PullReply(msgspec.Struct, tag="pulled"):
    handle: str
    ok: bool
    message: str = ""
    reconnect: bool = False  # the pair's transport broke: pull again over a new connection
    checksums: dict[str, int] = {}  # CRC-32 of each cache group's part of the buffer, as sent


_encoder = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(Connect | Pull | Renew | Release)
_to_decode = msgspec.msgpack.Decoder(ConnectReply | PullReply)


def _count(stats: HandoffStats, coordinator: KvCacheCoordinator, num_tokens: int, seconds: float) -> float:
    stats.transfers += 1
    stats.seconds += seconds
    for name, n in handoff_bytes(coordinator.plan, num_tokens).items():
        stats.bytes_by_group[name] = stats.bytes_by_group.get(name, 0) + n
    return seconds


# ---- prefill end ---------------------------------------------------------------------------------
@dataclass
class _Held:
    num_tokens: int
    deadline: float


@dataclass
class _Send:
    handle: str
    transfer: Transfer
    started: float
    num_tokens: int


class _HandoffEnd:
    def __init__(
        self,
        coordinator: KvCacheCoordinator,
        fingerprint: PlanFingerprint,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.coordinator = coordinator
        self.fingerprint = fingerprint
        self.device = device
        self.timeout_s = timeout_s
        self.stats = HandoffStats()
        self._ctx = zmq.Context()


class KvSender(_HandoffEnd):
    """Holds prefilled requests' blocks until a decode worker pulls them (or the timeout passes)."""

    def __init__(
        self,
        coordinator: KvCacheCoordinator,
        fingerprint: PlanFingerprint,
        device: torch.device,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
    ) -> None:
        super().__init__(coordinator, fingerprint, device, timeout_s)
        self.store = host_store(host, port, timeout_s)
        self.store_address = f"{host}:{self.store.port}"
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.bind(f"tcp://{host}:*")
        self.control = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.held: dict[str, _Held] = {}
        self.sending: list[_Send] = []
        self.groups: dict[bytes, PairGroup] = {}

    def hold(self, request_id: str, num_tokens: int) -> KvHandoff:
        """Keep ``request_id``'s blocks (its coordinator tables) for a decode worker to pull."""
        self.held[request_id] = _Held(num_tokens, time.monotonic() + self.timeout_s)
        self.stats.events += 1
        return KvHandoff(
            request_id,
            self.control,
            self.store_address,
            num_tokens,
            self.fingerprint.digest(),
            bytes_by_group=handoff_bytes(self.coordinator.plan, num_tokens),
        )

    def release(self, request_id: str) -> bool:
        """Give up a held request's blocks (aborted, or finished by a stop string); False if not held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.coordinator.release(request_id)
        self.stats.events += 1
        return True

    @property
    def busy(self) -> bool:
        return bool(self.held or self.sending)

    def poll(self) -> None:
        while True:
            try:
                identity, data = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = _to_prefill.decode(data)
            if isinstance(message, Connect):
                self._connect(identity, message)
            elif isinstance(message, Renew):
                self._renew(message.handles)
            elif isinstance(message, Release):
                for handle in message.handles:
                    self.release(handle)
            else:
                self.socket.send_multipart([identity, _encoder.encode(self._pull(identity, message))])
        self._finish_sends()
        now = time.monotonic()
        for request_id in [r for r, h in self.held.items() if h.deadline < now]:
            log.warning(
                "no decode worker pulled %s within %.0f s; its blocks are freed", request_id, self.timeout_s
            )
            self.stats.expired += 1
            self.release(request_id)

    def _renew(self, handles: list[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        for handle in handles:
            if (held := self.held.get(handle)) is not None:
                held.deadline = deadline

    def _connect(self, identity: bytes, message: Connect) -> None:
        why = self.fingerprint.mismatch(PlanFingerprint.from_json(message.fingerprint))
        ours = self.fingerprint.to_json()
        self.socket.send_multipart([identity, _encoder.encode(ConnectReply(why is None, why or "", ours))])
        if why is not None:
            log.error("refused a decode worker: %s", why)
            return
        try:
            self.groups[identity] = pair_group(
                self.store, message.pair_id, PREFILL_RANK, self.device, self.timeout_s
            )
        except RuntimeError:
            log.exception("a decode worker did not join its KV transfer group")

    def _pull(self, identity: bytes, message: Pull) -> PullReply:
        held = self.held.pop(message.handle, None)
        group = self.groups.get(identity)
        if held is None or group is None:
            if held is not None:  # its puller cannot receive it, and no other worker will ask for it
                self.coordinator.release(message.handle)
                self.stats.events += 1
            why = (
                "it is unknown, expired or aborted"
                if group is not None
                else "the decode worker is not connected"
            )
            return PullReply(
                message.handle,
                False,
                f"the prefill worker has no blocks for {message.handle}: {why}",
                reconnect=group is None,
            )
        if held.num_tokens != message.num_tokens:
            self.coordinator.release(message.handle)
            return PullReply(
                message.handle,
                False,
                f"{message.handle} holds {held.num_tokens} tokens, not {message.num_tokens}",
            )
        buffer = pack(self.coordinator.pools, self.coordinator.block_tables(message.handle), held.num_tokens)
        sums = checksums(self.coordinator.plan, held.num_tokens, buffer)
        self.coordinator.release(message.handle)  # the buffer owns a copy; cached blocks stay evictable
        self.stats.events += 1
        try:
            transfer = post_send(group, buffer, DECODE_RANK, message.tag)
        except RuntimeError as exc:  # the pair broke (its decode worker died): fail this pull, not the engine
            self.groups.pop(identity, None)
            self.stats.failed += 1
            log.warning("sending %s failed: %s", message.handle, exc)
            return PullReply(message.handle, False, f"sending {message.handle} failed: {exc}", reconnect=True)
        self.sending.append(_Send(message.handle, transfer, time.monotonic(), held.num_tokens))
        return PullReply(message.handle, True, checksums=sums)

    def _finish_sends(self) -> None:
        for send in [s for s in self.sending if s.transfer.done()]:
            self.sending.remove(send)
            self.stats.events += 1  # the counts change: a new snapshot is due
            try:
                send.transfer.result()
                _count(self.stats, self.coordinator, send.num_tokens, time.monotonic() - send.started)
            except RuntimeError as exc:
                self.stats.failed += 1
                log.warning("sending %s failed: %s", send.handle, exc)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._ctx.term()


# ---- decode end ----------------------------------------------------------------------------------
@dataclass
class _Peer:
    socket: zmq.Socket
    store: dist.Store
    group: PairGroup


@dataclass
class _Import:
    peer: str
    handoff: KvHandoff
    tag: int
    deadline: float
    started: float
    transfer: Transfer | None = None
    checksums: dict[str, int] = field(default_factory=dict)  # the sender's, from its PullReply


class KvReceiver(_HandoffEnd):
    """Pulls requests' blocks from prefill workers into blocks the caller has already allocated."""

    def __init__(
        self,
        coordinator: KvCacheCoordinator,
        fingerprint: PlanFingerprint,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        super().__init__(coordinator, fingerprint, device, timeout_s)
        self.peers: dict[str, _Peer] = {}
        self.imports: dict[str, _Import] = {}
        self._orphans: list[Transfer] = []  # receives of cancelled imports, kept alive until they end
        # Cancelled before their pull was answered: the send still comes, and must meet a receive (an
        # unmatched send times out and closes the pair, failing every later pull over it).
        self._unanswered: dict[tuple[str, str], _Import] = {}
        self._tags = 0
        # Pull to unpacked, of each import that arrived (every group moves in one buffer: no split by
        # group); the caller takes its request's entry when ``poll`` reports the arrival.
        self.seconds: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return bool(self.imports)

    def start(self, request_id: str, handoff: KvHandoff) -> None:
        """Pull ``handoff`` into ``request_id``'s blocks; the outcome comes from ``poll``.

        Raises HandoffError (or FingerprintMismatch) when the prefill worker cannot be reached or refused.
        """
        peer = self._peer(handoff)
        if handoff.plan and handoff.plan != self.fingerprint.digest():
            raise FingerprintMismatch(
                f"the blocks of {handoff.handle} were made under another cache plan ({handoff.plan}) than "
                f"this worker's ({self.fingerprint.digest()}): was the prefill worker at {handoff.control} "
                "restarted with other flags?"
            )
        self._tags = (self._tags + 1) % _TAG_SPACE
        now = time.monotonic()
        self.imports[request_id] = _Import(handoff.control, handoff, self._tags, now + self.timeout_s, now)
        peer.socket.send(_encoder.encode(Pull(handoff.handle, self._tags, handoff.num_tokens)), zmq.NOBLOCK)

    def renew(self, handoffs: list[KvHandoff]) -> None:
        """Tell each prefill worker that these handoffs are still wanted (queued here, waiting for room),
        so that it keeps their blocks for another timeout."""
        self._tell(handoffs, Renew)

    def release(self, handoffs: list[KvHandoff]) -> None:
        """Tell each prefill worker that these handoffs will never be pulled (their requests ended before
        their pull), so that it frees their blocks now rather than at the timeout."""
        self._tell(handoffs, Release)

    def _tell(self, handoffs: list[KvHandoff], message: type[Renew] | type[Release]) -> None:
        """Best effort: an unreachable prefill worker is left to its own timeout (or the pull's error)."""
        by_peer: dict[str, list[KvHandoff]] = {}
        for handoff in handoffs:
            by_peer.setdefault(handoff.control, []).append(handoff)
        for control, same in by_peer.items():
            try:
                peer = self._peer(same[0])
                peer.socket.send(_encoder.encode(message([h.handle for h in same])), zmq.NOBLOCK)
            except Exception as exc:
                log.warning(
                    "could not send %s of %d handoffs to %s: %s", message.__name__, len(same), control, exc
                )

    def cancel(self, request_id: str) -> bool:
        imp = self.imports.pop(request_id, None)
        if imp is not None and imp.transfer is not None:
            self._orphans.append(imp.transfer)
        elif imp is not None:
            self._unanswered[(imp.peer, imp.handoff.handle)] = imp
        return imp is not None

    def poll(self) -> list[tuple[str, str | None]]:
        """-> (request id, None when its blocks arrived, else why not) for every import that ended."""
        ended = self._poll()
        self.stats.events += len(ended)
        return ended

    def _poll(self) -> list[tuple[str, str | None]]:
        ended: list[tuple[str, str | None]] = []
        for address, peer in list(self.peers.items()):
            ended += self._replies(address, peer)
        now = time.monotonic()
        for request_id, imp in list(self.imports.items()):
            if imp.transfer is not None and imp.transfer.done():
                ended.append((request_id, self._receive(request_id, imp)))
            elif imp.deadline < now:
                ended.append(
                    (request_id, self._fail(request_id, f"no blocks arrived within {self.timeout_s:.0f} s"))
                )
        # A failure above dropped its peer: the replies still owed over that connection can never be read
        unanswerable = [r for r, i in self.imports.items() if i.transfer is None and i.peer not in self.peers]
        why = "the connection was dropped (another pull over it failed) before this pull was answered"
        ended += [(r, self._fail(r, why)) for r in unanswerable]
        self._orphans = [t for t in self._orphans if not t.done()]
        return ended

    def _replies(self, address: str, peer: _Peer) -> list[tuple[str, str | None]]:
        ended: list[tuple[str, str | None]] = []
        while True:
            try:
                reply = _to_decode.decode(peer.socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return ended
            request_id = next(
                (
                    r
                    for r, i in self.imports.items()
                    if i.peer == address and i.handoff.handle == getattr(reply, "handle", None)
                ),
                None,
            )
            if isinstance(reply, PullReply) and reply.reconnect:  # the pair broke (even if its import
                # was cancelled): fail what waits on it; the next pull connects again
                waiting = [r for r, i in self.imports.items() if i.peer == address]
                self._drop(address)
                return ended + [(r, self._fail(r, reply.message)) for r in waiting]
            if request_id is None and isinstance(reply, PullReply):
                self._drain(address, peer, reply)
            if request_id is None or not isinstance(reply, PullReply):
                continue
            imp = self.imports[request_id]
            imp.checksums = reply.checksums
            if not reply.ok:
                self.imports.pop(request_id)
                self.stats.failed += 1
                ended.append((request_id, reply.message))
                continue
            imp.transfer = post_recv(
                peer.group, self.coordinator.plan, imp.handoff.num_tokens, PREFILL_RANK, imp.tag, self.device
            )

    def _receive(self, request_id: str, imp: _Import) -> str | None:
        assert imp.transfer is not None
        try:
            buffer = imp.transfer.result()
        except RuntimeError as exc:
            return self._fail(request_id, f"the transfer failed: {exc}")
        self.imports.pop(request_id)
        corrupt = corrupt_groups(self.coordinator.plan, imp.handoff.num_tokens, buffer, imp.checksums)
        if corrupt:  # the transport is fine (the bytes arrived): fail this request, keep the pair
            self.stats.failed += 1
            self.stats.corrupt += 1
            log.error("the KV handoff of %s arrived corrupted in groups %s", request_id, corrupt)
            return (
                f"the KV handoff from the prefill worker at {imp.peer} arrived corrupted: the checksums of "
                f"cache groups {', '.join(corrupt)} do not match the sender's"
            )
        unpack(
            self.coordinator.pools, self.coordinator.block_tables(request_id), imp.handoff.num_tokens, buffer
        )
        took = time.monotonic() - imp.started
        self.seconds[request_id] = _count(self.stats, self.coordinator, imp.handoff.num_tokens, took)
        return None

    def _fail(self, request_id: str, why: str) -> str:
        """End an import that went wrong; its peer's group may hold a stuck receive, so it is dropped."""
        imp = self.imports.pop(request_id)
        self.stats.failed += 1
        self._drop(imp.peer)
        return f"the KV handoff from the prefill worker at {imp.peer} failed: {why}"

    def _drain(self, address: str, peer: _Peer, reply: PullReply) -> None:
        """Receive (and discard) the blocks of a cancelled import whose pull the prefill worker granted."""
        imp = self._unanswered.pop((address, reply.handle), None)
        if imp is not None and reply.ok:
            n, plan = imp.handoff.num_tokens, self.coordinator.plan
            self._orphans.append(post_recv(peer.group, plan, n, PREFILL_RANK, imp.tag, self.device))

    def _drop(self, address: str) -> None:
        self._unanswered = {k: v for k, v in self._unanswered.items() if k[0] != address}
        peer = self.peers.pop(address, None)
        if peer is None:
            return
        peer.socket.close(linger=0)

    def _peer(self, handoff: KvHandoff) -> _Peer:
        peer = self.peers.get(handoff.control)
        if peer is None:
            peer = self.peers[handoff.control] = self._connect(handoff)
        return peer

    def _connect(self, handoff: KvHandoff) -> _Peer:
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(handoff.control)
        pair_id = uuid.uuid4().hex
        try:
            socket.send(_encoder.encode(Connect(pair_id, self.fingerprint.to_json())), zmq.NOBLOCK)
            if not socket.poll(int(self.timeout_s * 1000)):
                raise HandoffError(
                    f"the prefill worker at {handoff.control} did not answer within {self.timeout_s:.0f} s"
                )
            reply = _to_decode.decode(socket.recv())
            assert isinstance(reply, ConnectReply)
            if not reply.ok:
                raise FingerprintMismatch(
                    f"the prefill worker at {handoff.control} refused the KV handoff: {reply.message}"
                )
            self.fingerprint.check(
                PlanFingerprint.from_json(reply.fingerprint), f"the prefill worker at {handoff.control}"
            )
            store = join_store(handoff.store, self.timeout_s)
            group = pair_group(store, pair_id, DECODE_RANK, self.device, self.timeout_s)
        except BaseException:
            socket.close(linger=0)
            raise
        return _Peer(socket, store, group)

    def close(self) -> None:
        for address in list(self.peers):
            self._drop(address)
        self._ctx.term()
