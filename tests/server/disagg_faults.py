"""Faults for the disaggregation tests, injected through $HYBRIDSERVE_PLUGINS into an engine-core process.

``die_mid_transfer``: a prefill worker accepts a decode worker's pull of a request whose prompt holds
DIE_TOKENS tokens, then its process dies before the blocks leave.
"""

from __future__ import annotations

import os

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
