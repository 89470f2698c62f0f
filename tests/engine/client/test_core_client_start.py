"""Starting the engine-core process: the API process waits for it as long as --engine-ready-timeout says."""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve.config import EngineConfig
from hybridserve.engine.client.core_client import EngineCoreClient, ready_deadline
from hybridserve.engine.client.dp_client import DPEngineCoreClient
from hybridserve.engine.errors import EngineDeadError


def _config(checkpoint: Path, timeout: float) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint), device="cpu", num_blocks=64, engine_ready_timeout=timeout, enforce_eager=True
    )


def test_a_core_not_ready_in_time_is_reported_and_stopped(tiny_checkpoint: Callable[[str], Path]) -> None:
    """A start-up past the timeout fails with the flag to raise in the message, and no core lives on."""
    with pytest.raises(EngineDeadError, match=r"within 0.01 s \(--engine-ready-timeout; 0: no limit\)"):
        EngineCoreClient(_config(tiny_checkpoint("mixed"), 0.01))
    assert not multiprocessing.active_children()


def test_timeout_0_waits_as_long_as_the_core_lives(tiny_checkpoint: Callable[[str], Path]) -> None:
    assert ready_deadline(0) == math.inf and ready_deadline(5) < math.inf
    client = EngineCoreClient(_config(tiny_checkpoint("mixed"), 0))
    try:
        assert client.process.is_alive() and client.ready is not None
    finally:
        client.close()
    assert not client.process.is_alive()


def test_the_flag_takes_seconds() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli(parser.parse_args(["--engine-ready-timeout", "90.5"]))
    assert config.engine_ready_timeout == 90.5
    assert EngineConfig(enforce_eager=True).engine_ready_timeout == 1800.0


def test_data_parallel_ranks_not_ready_in_time_are_reported_and_stopped(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    config = dataclasses.replace(_config(tiny_checkpoint("mixed"), 0.01), data_parallel_size=2)
    with pytest.raises(EngineDeadError, match=r"ranks \[0, 1\] did not start within 0.01 s \(--engine-ready"):
        DPEngineCoreClient(config)
    assert not multiprocessing.active_children()
