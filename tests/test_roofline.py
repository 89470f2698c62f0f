"""benchmarks/roofline.py computes the achieved and fraction columns itself, from measured result files."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import roofline


def _level(label: str, concurrency: int, tpot_ms: float, tok_s: float) -> dict:
    config = {"label": label, "max_concurrency": concurrency, "input_len": 96, "output_len": 64}
    return {"config": config, "tpot_ms": {"p50": tpot_ms}, "output_throughput": tok_s}


def test_achieved_columns_come_from_the_result_files(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint("mixed")
    summary = {"results": [{"engine": "hybridserve", "levels": [_level("hybridserve-c4", 4, 20.0, 150.0)]}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "bench.json").write_text(json.dumps([_level("hybridserve-compiled-c1", 1, 10.0, 80.0)]))
    (tmp_path / "peer.json").write_text(json.dumps([_level("transformers-c1", 1, 5.0, 99.0)]))  # not ours
    out = tmp_path / "report.json"
    argv = ["--checkpoint", str(ckpt), "--threads", "1", "--bw-mib", "8", "--mm-sizes", "64"]
    argv += ["--out", str(out)]
    results = [str(tmp_path / f) for f in ("summary.json", "bench.json", "peer.json")]
    assert roofline.main([*argv, "--results", *results]) == 0
    report = json.loads(out.read_text())
    rows = {r["engine"]: r for r in report["achieved"]}
    assert set(rows) == {"hybridserve", "hybridserve-compiled"}
    bandwidth, flops = report["bandwidth"]["copy_gb_s"] * 1e9, report["matmul_fp32"]["gflop_s"] * 1e9
    expected = [("hybridserve", 4, 200.0, 150.0), ("hybridserve-compiled", 1, 100.0, 80.0)]
    for engine, batch, decode, output in expected:
        row = rows[engine]
        assert (row["batch"], row["context"]) == (batch, 96 + 32)  # the prompt and half the output
        profile = roofline.decode_profile(roofline.read_checkpoint(ckpt), 128, None, None)
        bound = roofline.bounds(profile, bandwidth, flops, [batch])[0]["upper_bound_tok_s"]
        assert row["bound_tok_s"] == pytest.approx(bound)
        assert row["decode_tok_s"] == pytest.approx(decode)  # concurrency / TPOT p50
        assert row["decode_fraction"] == pytest.approx(decode / bound)
        assert row["output_fraction"] == pytest.approx(output / bound)


def test_decode_steps_come_from_profile_step_results(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint("mixed")
    plain = {"median": 40.0, "n": 20}
    run = {"batch": 8, "compile_decode": True, "context_at_phase_start": {"plain": 100}}
    (tmp_path / "step.json").write_text(json.dumps(run | {"unpreempted_wall_ms_per_step": {"plain": plain}}))
    out = tmp_path / "report.json"
    argv = ["--checkpoint", str(ckpt), "--threads", "1", "--bw-mib", "8", "--mm-sizes", "64"]
    assert roofline.main([*argv, "--out", str(out), "--steps", str(tmp_path / "step.json")]) == 0
    report = json.loads(out.read_text())
    (row,) = report["achieved_steps"]
    assert (row["engine"], row["batch"], row["context"]) == ("compiled", 8, 110)  # mid-run context
    bandwidth, flops = report["bandwidth"]["copy_gb_s"] * 1e9, report["matmul_fp32"]["gflop_s"] * 1e9
    profile = roofline.decode_profile(roofline.read_checkpoint(ckpt), 110, None, None)
    bound = roofline.bounds(profile, bandwidth, flops, [8])[0]["upper_bound_tok_s"]
    assert row["step_tok_s"] == pytest.approx(200.0)  # batch / median step
    assert row["step_fraction"] == pytest.approx(200.0 / bound)
