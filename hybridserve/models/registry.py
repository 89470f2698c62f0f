"""model_type -> how to build and load it: the engine's one way to a model (``interface.PagedModel``).

A new architecture is a module in ``models/`` and one entry in ``MODELS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.models import loader, tiny_dense
from hybridserve.models.interface import PagedModel
from hybridserve.models.loader import CheckpointError, ModelShard, read_config

__all__ = ["MODELS", "CheckpointError", "ModelEntry", "build_meta_model", "load_model", "read_config"]


@dataclass(frozen=True)
class ModelEntry:
    """``load(folder, dtype, device, keep_quantized, native_fp8, shard)``: the model with its weights;
    ``build_meta(folder, dtype, shard)``: shapes and dtypes on the meta device (``hybridserve plan``)."""

    load: Callable[..., PagedModel[Any]]
    build_meta: Callable[..., PagedModel[Any]]


MODELS: dict[str, ModelEntry] = {
    "deepseek_v4": ModelEntry(loader.load_model, loader.build_meta_model),
    "tiny_dense": ModelEntry(tiny_dense.load_model, tiny_dense.build_meta_model),
}


def entry(folder: str | Path) -> ModelEntry:
    model_type = read_config(folder).get("model_type")
    if model_type not in MODELS:
        raise CheckpointError(f"{folder}: unsupported model_type {model_type!r}; supported: {sorted(MODELS)}")
    return MODELS[model_type]


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_quantized: bool = True,
    native_fp8: bool = False,
    shard: ModelShard | None = None,
) -> PagedModel[Any]:
    """The model of ``folder`` on ``device`` with every weight (see ``loader.load_model``)."""
    return entry(folder).load(folder, dtype, device, keep_quantized, native_fp8, shard)


def build_meta_model(
    folder: str | Path, dtype: torch.dtype, shard: ModelShard | None = None
) -> PagedModel[Any]:
    """The model of ``folder`` (or one rank's part of it) with shapes and dtypes but no memory."""
    return entry(folder).build_meta(folder, dtype, shard)
