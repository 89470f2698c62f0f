"""Smoke test of ``hybridserve bench serve`` against our server with 4 prompts (no benchmark runs in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.cli import main
from tests.server.conftest import API_KEY, Server


@pytest.mark.parametrize(("endpoint", "workload"), [("completions", "random"), ("chat", "multi-turn")])
def test_bench_client_measures_our_server(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture, endpoint: str, workload: str
) -> None:
    out = tmp_path / "result.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--endpoint",
            endpoint,
            "--workload",
            workload,
            "--num-prompts",
            "4",
            "--input-len",
            "12",
            "--output-len",
            "6",
            "--turns",
            "2",
            "--concurrency",
            "1,4",
            "--warmup",
            "1",
            "--tokenizer",
            str(server.folder),
            "--slo",
            "ttft=60000,tpot=60000",
            "--result-json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    assert [r["config"]["max_concurrency"] for r in results] == [1, 4]
    for r in results:
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["output_throughput"] > 0 and r["ttft_ms"]["p50"] > 0 and r["goodput"] > 0
    assert "Output token throughput" in capsys.readouterr().out
