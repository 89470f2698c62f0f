"""A server plugin for tests ($HYBRIDSERVE_PLUGINS): compiled steps traced by dynamo's "eager" backend,
which compiles no code, so a test of the compiled default runs in seconds."""

from __future__ import annotations


def install() -> None:
    from hybridserve.engine.worker import decode_graphs, prefill_graphs

    decode_graphs.GRAPH_BACKEND = "eager"
    prefill_graphs.GRAPH_BACKEND = "eager"
