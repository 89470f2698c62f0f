"""Request bodies as the router forwards them: the client's bytes as sent, the router's fields appended.

Decoding and encoding again would change what the client sent (numbers, escapes, key order) and can fail
on text JSON allows but UTF-8 cannot hold; appending members instead relies on the rule every parser the
workers use keeps (``json.loads``, msgspec): of a key given twice, the last value wins.
"""

from __future__ import annotations

import json
from typing import Any


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw``, a JSON object (validated at the edge), with ``fields`` set over whatever it held."""
    if not fields:
        return raw
    body = raw.rstrip()
    assert body.endswith(b"}"), "the edge validated a JSON object"
    head = body[:-1].rstrip()
    members = json.dumps(fields, separators=(",", ":"), allow_nan=False)[1:-1].encode()
    return head + (b"" if head.endswith(b"{") else b",") + members + b"}"
