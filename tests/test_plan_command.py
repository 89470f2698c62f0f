"""``hybridserve plan`` with a launch topology's flags: each side's plan, rank by rank, is the plan that
side's own ``serve`` command line builds (checked against the single-engine plan, which
tests/test_cli_plan.py checks against the engine), with each rank's expert shard and MTP draft pools."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridserve.cli import main

SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
FLAGS = ["--block-tokens", "8", "--num-blocks", "40", "--max-num-batched-tokens", "64"]
FLAGS += ["--kv-cache-dtype", "fp8", "--speculative-config", SPEC]


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.fixture(scope="module")
def folder(mtp_checkpoint: Callable[[str], Path]) -> str:
    return str(mtp_checkpoint("mixed"))


def test_each_side_is_planned_as_its_serve_command_would(folder: str, capsys) -> None:
    top = ["--model", folder, *FLAGS, "--prefill-dp", "2", "--decode-dp", "1", "--enable-expert-parallel"]
    sides = _plan(capsys, *top)
    for mode, n in (("prefill", 2), ("decode", 1)):
        side = sides[mode]
        alone = _plan(
            capsys, "--model", folder, *FLAGS, "--data-parallel-size", str(n), "--enable-expert-parallel"
        )
        assert side["data_parallel_size"] == n and side["kv_cache_dtype"] == "fp8" and side["speculative"]
        assert side["groups"] == alone["groups"] and side["total_bytes"] == alone["total_bytes"]
        blocks = {g["name"]: g["blocks"] for g in alone["groups"]}
        draft = sum(g["bytes"] for g in alone["groups"] if g["draft"])
        assert side["draft_groups"] == ["mtp_kv"] and draft > 0
        assert len(side["ranks"]) == n
        for rank, single in zip(side["ranks"], alone["ranks"], strict=True):
            assert {k: rank[k] for k in single} == single  # weights, cache and total bytes
            assert rank["blocks"] == blocks and rank["draft_bytes"] == draft
    shards = [r["experts"] for r in sides["prefill"]["ranks"]]
    assert shards == [[0, 2], [2, 4]]  # the tiny model's 4 routed experts, half on each rank
    assert "experts" not in sides["decode"]["ranks"][0]  # one rank holds them all: no expert parallelism
    prefill_weights = [r["weight_bytes"] for r in sides["prefill"]["ranks"]]
    assert max(prefill_weights) < sides["decode"]["ranks"][0]["weight_bytes"]


def test_the_text_names_each_side_and_rank(folder: str, capsys) -> None:
    argv = ["plan", "--model", folder, *FLAGS, "--prefill-dp", "1", "--decode-dp", "2"]
    assert main([*argv, "--enable-expert-parallel"]) == 0
    out = capsys.readouterr().out
    prefill, decode = out.split("== decode side: ")
    assert prefill.startswith("== prefill side: 1 rank, ")
    assert decode.startswith("2 ranks (expert parallel), ")
    assert "experts [0, 2)" in decode and "experts [2, 4)" in decode and "experts" not in prefill
    for side in (prefill, decode):
        assert "MTP draft pools mtp_kv: " in side and "mtp_kv=40" in side


def test_one_engine_without_topology_flags_prints_no_sides(folder: str, capsys) -> None:
    assert main(["plan", "--model", folder, *FLAGS]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: ") and "side" not in out and "single rank" in out
