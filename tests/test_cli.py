from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve.cli import main


def test_generate_prints_completions(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture
) -> None:
    folder = tiny_checkpoint("mixed")
    rc = main(
        [
            "generate",
            "--enforce-eager",
            "--model",
            str(folder),
            "--block-tokens",
            "8",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "It is",
            "a truth",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("[5 tokens, finish_reason=length]") == 2 and out.startswith("It is")


def test_plan_prints_groups_and_capacity(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture
) -> None:
    rc = main(
        [
            "plan",
            "--model",
            str(tiny_checkpoint("mixed")),
            "--block-tokens",
            "8",
            "--kv-cache-memory",
            "4MiB",
            "--max-model-len",
            "300",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for group in ("swa_kv", "csa_state", "csa_rows", "hca_state", "hca_rows"):
        assert group in out
    assert "requests of 300 tokens that fit at once" in out
    assert "layout=arena" in out and "blocks/page" in out  # the default: one arena for every group


def test_plan_shows_the_fixed_split_when_asked(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture
) -> None:
    folder = str(tiny_checkpoint("mixed"))
    args = ["plan", "--model", folder, "--block-tokens", "8", "--kv-cache-memory", "4MiB"]
    assert main([*args, "--cache-layout", "fixed"]) == 0
    fixed = capsys.readouterr().out
    assert "layout=fixed" in fixed and "blocks/page" not in fixed
    assert main([*args, "--cache-layout", "paged"]) == 2
    assert "choose arena or fixed" in capsys.readouterr().err


def test_bad_arguments_are_a_clear_error(
    tiny_checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture
) -> None:
    rc = main(["plan", "--model", str(tiny_checkpoint("mixed")), "--block-tokens", "6"])
    assert rc == 2 and "multiple of" in capsys.readouterr().err
    assert main(["plan", "--model", "/nonexistent"]) == 2
