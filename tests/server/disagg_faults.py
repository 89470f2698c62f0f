"""Faults for the disaggregation tests, injected through $HYBRIDSERVE_PLUGINS into an engine-core process.

``die_mid_transfer``: a prefill worker accepts a decode worker's pull of a request whose prompt holds
DIE_TOKENS tokens, then its process dies before the blocks leave. ``corrupt_transfer``: one byte of a
CORRUPT_TOKENS-token prompt's blocks changes on the way.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridserve.kv_transfer import transport
from hybridserve.kv_transfer.handoff import Transfer
from hybridserve.kv_transfer.transport import KvSender, Pull, PullReply, _encoder

DIE_TOKENS = 31


def die_mid_transfer() -> None:
    pull = KvSender._pull

    def faulty(self: KvSender, identity: bytes, message: Pull) -> PullReply:
        if message.num_tokens == DIE_TOKENS:
            self.socket.send_multipart([identity, _encoder.encode(PullReply(message.handle, True))])
            os._exit(1)
        return pull(self, identity, message)

    KvSender._pull = faulty  # type: ignore[method-assign]


CORRUPT_TOKENS = 29


def corrupt_transfer() -> None:
    """A prefill worker flips one byte of the blocks it sends for a prompt of CORRUPT_TOKENS tokens, after
    their checksums were taken (what a bad link or a buggy copy would do)."""
    pull = KvSender._pull

    def faulty(self: KvSender, identity: bytes, message: Pull) -> PullReply:
        if message.num_tokens != CORRUPT_TOKENS:
            return pull(self, identity, message)
        send = transport.post_send

        def flipped(group: Any, buffer: torch.Tensor, peer: int, tag: int) -> Transfer:
            buffer[buffer.numel() // 2] ^= 0xFF
            return send(group, buffer, peer, tag)

        transport.post_send = flipped
        try:
            return pull(self, identity, message)
        finally:
            transport.post_send = send

    KvSender._pull = faulty  # type: ignore[method-assign]
