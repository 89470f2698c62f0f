"""/metrics of a side of several ranks: every per-rank series names its rank, and each rank's numbers are
its own (the totals beside them sum the ranks)."""

from __future__ import annotations

from types import SimpleNamespace

from hybridserve.bench.server_process import parse_metrics
from hybridserve.engine.stats import EngineSnapshot, HandoffStats, PoolUsage
from hybridserve.server.metrics import ServerMetrics


def _value(m: dict[str, float], name: str, **labels: object) -> float:
    """The sample of ``name`` with exactly ``labels`` (in whatever order the exposition writes them)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    found = [
        v for k, v in m.items() if k.startswith(name + "{") and set(k[len(name) + 1 : -1].split(",")) == want
    ]
    assert len(found) == 1, (name, labels)
    return found[0]


def _rank(rank: int) -> EngineSnapshot:
    return EngineSnapshot(
        num_running=rank + 1,
        num_waiting=rank + 2,
        kv_blocks={"swa_kv": PoolUsage(3 + rank, 10, 0, 0)},
        dp_rank=rank,
        expert_tokens={2 * rank: 5 + rank, 2 * rank + 1: 7 + rank},  # expert parallel: 2 experts a rank
        handoff=HandoffStats(transfers=4 + rank, seconds=0.5 + rank, bytes_by_group={"swa_kv": 100}),
    )


def test_every_per_rank_series_is_labelled_by_rank() -> None:
    ranks = {r: _rank(r) for r in (0, 1)}
    total = EngineSnapshot(handoff=HandoffStats(transfers=9, seconds=2.0, bytes_by_group={"swa_kv": 200}))
    front = SimpleNamespace(stats=total, rank_stats=ranks, num_waiting=3, on_finish=[])
    metrics = ServerMetrics()
    metrics.attach(front)  # type: ignore[arg-type]
    m = parse_metrics(metrics.render().decode())
    per_rank = {k: v for k, v in m.items() if k.startswith(("hybridserve_dp_rank_", "hybridserve_expert_"))}
    assert per_rank and all('rank="' in k for k in per_rank), per_rank
    for r in (0, 1):
        assert _value(m, "hybridserve_dp_rank_num_requests_running", rank=r) == r + 1
        assert _value(m, "hybridserve_dp_rank_num_requests_waiting", rank=r) == r + 2
        assert _value(m, "hybridserve_dp_rank_kv_blocks_used", rank=r, group="swa_kv") == 3 + r
        assert _value(m, "hybridserve_dp_rank_kv_handoff_transfers_total", rank=r) == 4 + r
        assert _value(m, "hybridserve_dp_rank_kv_handoff_seconds_total", rank=r) == 0.5 + r
        assert _value(m, "hybridserve_expert_tokens_total", rank=r, expert=2 * r + 1) == 7 + r
    assert m["hybridserve_kv_handoff_transfers_total"] == 9
    assert m["hybridserve_kv_handoff_seconds_total"] == 2.0
