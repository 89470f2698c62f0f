"""A short soak in CI: mixed, hostile traffic against a tight-pool server, then no leak and no 5xx.

The full run (5,000 requests, bundled model) is in benchmarks/README.md; this is the same code,
100 requests against a tiny model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hybridserve.bench.soak import run_soak
from hybridserve.cli import build_parser


def test_short_soak_leaves_nothing_behind(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    result = tmp_path / "soak.json"
    args = build_parser().parse_args(
        [
            "bench", "soak",
            "--model", str(tiny_checkpoint("mixed")),
            "--requests", "100",
            "--concurrency", "12",
            "--num-blocks", "40",
            "--server-arg=--block-tokens=8",
            "--rss-bound-mib", "64",
            "--latency-factor", "1000",  # too few requests per quarter to judge drift on a shared CI machine
            "--result-json", str(result),
        ]
    )  # fmt: skip
    code = run_soak(args)
    report = json.loads(result.read_text())
    assert code == 0, report["failures"]
    assert report["requests"] == 100 and report["server_errors"] == 0 and not report["problems"]
    assert report["preemptions"] > 0 and report["evictions"] > 0
    assert not any(report["kv_blocks_used_after"].values()) and report["server_exit"] == 0
    assert {"abort", "disconnect", "malformed", "oversize", "n_gt_1"} <= set(report["by_kind"])
