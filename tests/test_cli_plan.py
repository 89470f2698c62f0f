"""`hybridserve plan` reports the very plan an engine started with the same flags allocates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve.cli import build_parser, main
from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore

CASES = {
    "fp8_cache_block16": (
        "mixed",
        ["--kv-cache-dtype", "fp8", "--block-tokens", "16", "--kv-cache-memory", "3MiB"],
    ),
    "auto_no_prefix_cache": (
        "csa_heavy",
        [
            "--block-tokens",
            "8",
            "--kv-cache-memory",
            "5MiB",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "4",
        ],
    ),
    "num_blocks": ("mixed", ["--block-tokens", "8", "--num-blocks", "40", "--max-num-batched-tokens", "64"]),
    "mtp_draft_groups": (
        "mtp",
        [
            "--block-tokens",
            "8",
            "--kv-cache-memory",
            "4MiB",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 2}',
        ],
    ),
    "dp_rank_1_of_2": (
        "mixed",
        ["--block-tokens", "8", "--kv-cache-memory", "4MiB", "--data-parallel-size", "2"],
    ),
}


def _folder(name: str, tiny: Callable[[str], Path], mtp: Callable[[str], Path]) -> Path:
    return mtp("mixed") if name == "mtp" else tiny(name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_bytes_per_group_equal_the_engines(case, tiny_checkpoint, mtp_checkpoint, capsys):
    name, flags = CASES[case]
    argv = ["plan", "--model", str(_folder(name, tiny_checkpoint, mtp_checkpoint)), *flags]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = EngineConfig.from_cli(build_parser().parse_args(argv))
    if config.data_parallel_size > 1:
        config = EngineConfig(**{**vars(config), "data_parallel_rank": config.data_parallel_size - 1})
    plan = EngineCore(config).plan
    engine = {g.spec.name: (g.usable_blocks, g.total_bytes, g.spec.draft) for g in plan.groups}
    cli = {g["name"]: (g["blocks"], g["bytes"], g["draft"]) for g in report["groups"]}
    assert cli == engine
    assert report["block_tokens"] == plan.block_tokens and report["total_bytes"] == plan.total_bytes
    assert [r["cache_bytes"] for r in report["ranks"]] == [plan.total_bytes] * config.data_parallel_size
    assert ("mtp_kv" in cli) == (config.speculative is not None)


def _argv(folder: Path, *flags: str) -> list[str]:
    return ["plan", "--model", str(folder), "--block-tokens", "8", *flags]


def test_plan_text_gives_the_engines_bytes(tiny_checkpoint, capsys):
    argv = _argv(tiny_checkpoint("mixed"), "--kv-cache-memory", "3MiB")
    assert main(argv) == 0
    out = capsys.readouterr().out
    plan = EngineCore(EngineConfig.from_cli(build_parser().parse_args(argv))).plan
    assert f"cache {plan.total_bytes:,} B" in out


def test_plan_refuses_what_the_engine_refuses(tiny_checkpoint, capsys):
    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    assert main(_argv(tiny_checkpoint("mixed"), "--speculative-config", spec)) == 2
    assert "needs MTP weights" in capsys.readouterr().err
    tight = ["--num-blocks", "3", "--max-num-batched-tokens", "256"]
    assert main(_argv(tiny_checkpoint("mixed"), *tight)) == 2
    assert "no request could run" in capsys.readouterr().err


def test_plan_of_a_second_architecture_is_the_engines(tiny_dense_checkpoint, capsys):
    """`hybridserve plan` finds the model through the registry, as the engine does."""
    argv = _argv(tiny_dense_checkpoint(None), "--kv-cache-memory", "2MiB")
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = EngineCore(EngineConfig.from_cli(build_parser().parse_args(argv))).plan
    assert [g["name"] for g in report["groups"]] == [g.spec.name for g in plan.groups]
    assert report["total_bytes"] == plan.total_bytes
