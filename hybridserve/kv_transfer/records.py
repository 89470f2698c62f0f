"""What a KV handoff leaves behind as plain data: where a request's blocks wait, what moved, what failed.

Request state and engine stats hold these; they import no transport (no ZMQ, no torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass, field


class HandoffError(RuntimeError):
    pass


@dataclass
class KvHandoff:
    """Where a request's prefilled blocks wait and how much they hold; travels prefill -> router -> decode.

    ``generator_state`` is the request's seeded sampler after the draws of the prefill (``offset`` of
    them), so that a seeded request draws the same tokens as it would have on one worker.
    """

    handle: str
    control: str  # the prefill worker's ZMQ control endpoint
    store: str  # host:port of its TCPStore
    num_tokens: int  # computed tokens (the prompt); the first generated token is not computed yet
    plan: str = ""  # the sender's plan fingerprint (digest): blocks only mean something under it
    bytes_by_group: dict[str, int] = field(default_factory=dict)  # what the pull moves, per cache group
    seed: int | None = None
    offset: int = 0
    generator_state: bytes | None = None


@dataclass
class HandoffStats:
    transfers: int = 0
    failed: int = 0
    expired: int = 0
    corrupt: int = 0  # received blocks whose checksum did not match the sender's
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    events: int = 0  # blocks held, pulled, released, sent or received: a new snapshot is due
