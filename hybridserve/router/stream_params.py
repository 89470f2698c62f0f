"""A decode worker's SSE stream as the router passes it on: its ``kv_transfer_params`` comment taken out.

The worker reports its KV pull times in a comment event just before ``[DONE]``
(server/kv_transfer_params.py); the router reads it for its metrics and drops it, so clients get the
stream a co-located server sends. Events pass on whole; a chunk that ends mid-event holds its tail back
until the rest arrives (workers write whole events, so normally nothing waits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hybridserve.server.kv_transfer_params import COMMENT

_MARK = COMMENT.encode()
_END = b"\n\n"


@dataclass
class ParamsFilter:
    held: bytes = b""  # the start of an event whose end has not arrived
    found: list[dict[str, Any]] = field(default_factory=list)  # the params taken out so far

    def feed(self, chunk: bytes) -> bytes:
        """-> what of the stream to pass on now."""
        data = self.held + chunk
        cut = data.rfind(_END)
        if cut < 0:
            self.held = data
            return b""
        ready, self.held = data[: cut + len(_END)], data[cut + len(_END) :]
        if _MARK not in ready:
            return ready
        kept = []
        for event in ready.split(_END)[:-1]:
            if event.startswith(_MARK):
                self._read(event[len(_MARK) :])
            else:
                kept.append(event + _END)
        return b"".join(kept)

    def flush(self) -> bytes:
        """The rest of a stream that ended mid-event."""
        rest, self.held = self.held, b""
        return rest

    def _read(self, payload: bytes) -> None:
        try:
            params = json.loads(payload)
        except ValueError:
            return
        if isinstance(params, dict):
            self.found.append(params)
