from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import SPECS, add_random_mtp, make_checkpoint

# Tiny models are dominated by per-op overhead; one thread is fastest and steadiest on shared CI machines.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(name)``: folder of a tiny random transformers checkpoint (built once per session)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_checkpoint(SPECS[name], tmp_path_factory.mktemp(f"ckpt_{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def mtp_checkpoint(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``mtp_checkpoint(name)``: the tiny checkpoint ``name`` with random MTP weights (built once)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = tmp_path_factory.mktemp(f"mtp_{name}") / "model"
            add_random_mtp(tiny_checkpoint(name), built[name])
        return built[name]

    return get
