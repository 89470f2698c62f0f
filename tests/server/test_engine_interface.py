"""The server reads engine state through the engine's snapshot (engine/stats.py), never its internals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.source_imports import attribute_reads, source_files

# Which imports the API process may make: tests/test_import_rules.py.
ENGINE_INTERNALS = ("scheduler", "pools", "coordinator", "runner", "sampler", "core")
BELOW_THE_ENGINE = ("hybridserve.cache", "hybridserve.models", "hybridserve.layers")


@pytest.mark.parametrize("path", source_files("server"), ids=lambda p: p.name)
def test_server_never_touches_engine_internals(path):
    reads = [(line, a) for line, a in attribute_reads(path) if a in ENGINE_INTERNALS]
    assert not reads, f"{path.name} reads engine internals: {reads}"


def test_snapshot_is_all_the_metrics_read():
    """/metrics gets every KV-block number from the snapshot the engine-core process sends."""
    from hybridserve.engine.stats import EngineSnapshot, PoolUsage
    from hybridserve.server.metrics import ServerMetrics

    stats = EngineSnapshot(
        num_running=1, kv_blocks={"swa_kv": PoolUsage(3, 10, 2, 5)}, steps_by_path={"prefill_graph": 7}
    )
    # What metrics read of AsyncLLM: its latest snapshot, per-rank snapshots, waiting count, on_finish.
    front = SimpleNamespace(stats=stats, rank_stats={0: stats}, num_waiting=4, on_finish=[])
    metrics = ServerMetrics()
    metrics.attach(front)  # type: ignore[arg-type]
    text = metrics.render().decode()
    for line in (
        'hybridserve_kv_blocks_used{group="swa_kv"} 3.0',
        'hybridserve_kv_blocks_total{group="swa_kv"} 10.0',
        'hybridserve_kv_blocks_cached{group="swa_kv"} 2.0',
        'hybridserve_kv_blocks_evicted_total{group="swa_kv"} 5.0',
        "hybridserve_num_requests_running 1.0",
        "hybridserve_num_requests_waiting 4.0",
        'hybridserve_engine_steps_by_path_total{path="prefill_graph"} 7.0',
        'hybridserve_engine_steps_by_path_total{path="eager"} 0.0',
    ):
        assert line in text
