"""A server started with --speculative-config: the same text as the shared server (same trunk, speculation
off), vLLM's spec-decode metrics, acceptance figures in ``hybridserve bench serve``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hybridserve.cli import main
from tests.server.conftest import API_KEY, Server, start_server, stop_server


def test_spec_decode_server_output_and_metrics(
    server: Server, mtp_checkpoint: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    spec_server = start_server(
        mtp_checkpoint("mixed"),
        "--speculative-config",
        spec,
        "--max-num-seqs",
        "4",
        "--kv-cache-memory",
        "48MiB",
    )
    try:
        body = {"prompt": "It is a truth", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        texts = []
        for s, headers in ((spec_server, {}), (server, {"Authorization": f"Bearer {API_KEY}"})):
            r = httpx.post(
                f"{s.url}/v1/completions", json=body | {"model": s.model}, headers=headers, timeout=60
            )
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        metrics = spec_server.metrics()
        assert metrics["hybridserve_spec_decode_num_draft_tokens_total"] > 0
        assert metrics["hybridserve_spec_decode_num_drafts_total"] > 0
        assert "hybridserve_spec_decode_num_accepted_tokens_total" in metrics
        assert 'hybridserve_spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in metrics
        out = tmp_path / "bench.json"
        args = ["bench", "serve", "--base-url", spec_server.url, "--num-prompts", "3", "--input-len", "8"]
        args += ["--output-len", "8", "--warmup", "0", "--no-progress", "--result-json", str(out)]
        assert main(args) == 0
        (result,) = json.loads(out.read_text())
        assert result["spec_decode"]["num_draft_tokens"] > 0
        assert 0 <= result["spec_decode"]["acceptance_rate"] <= 1
        assert "Draft acceptance rate" in capsys.readouterr().out
        spec_server.wait_idle()
    finally:
        assert stop_server(spec_server) == 0
