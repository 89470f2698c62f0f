"""docs/flags.md is what ``make docs`` generates from the flags' help text today."""

from __future__ import annotations

from pathlib import Path

from hybridserve.config import EngineConfig
from hybridserve.flag_reference import render

FLAGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def test_the_flag_reference_is_current() -> None:
    assert FLAGS_DOC.read_text() == render(), "docs/flags.md is stale: run `make docs`"


def test_every_engine_flag_has_help_and_a_row() -> None:
    text = FLAGS_DOC.read_text()
    for f in EngineConfig.__dataclass_fields__.values():
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
        assert f"`--{f.name.replace('_', '-')}`" in text


def test_the_environment_does_not_leak_into_defaults(monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_PORT", "9999")
    monkeypatch.setenv("HYBRIDSERVE_MAX_NUM_SEQS", "7")
    assert render() == FLAGS_DOC.read_text()
