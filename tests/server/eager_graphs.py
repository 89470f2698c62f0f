"""``install``: compiled steps traced by dynamo's "eager" backend in an engine-core process (through
$HYBRIDSERVE_PLUGINS), as the in-process compiled tests do: the same graphs and guards, no inductor
compile, so a test server with --compile-decode --compile-prefill starts in seconds."""

from __future__ import annotations

from hybridserve.engine.worker import decode_graphs, prefill_graphs


def install() -> None:
    prefill_graphs.GRAPH_BACKEND = "eager"
    decode_graphs.GRAPH_BACKEND = "eager"
