"""Hugging Face folder -> model with weights (safetensors; FP8/FP4 checkpoints are dequantised)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from hybridserve.models.deepseek_v4 import DeepseekV4Model
from hybridserve.models.quant import dequantize, is_scale_tensor
from hybridserve.models.registry import resolve

_PROGRESS_MIN_BYTES = 256 << 20


class CheckpointError(ValueError):
    pass


class ModelShard(Protocol):
    """What one rank of a parallel world holds of the model (e.g. distributed.ExpertShard)."""

    def apply(self, model: nn.Module) -> None: ...

    def weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], num_experts: int
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    return dict(json.loads(path.read_text()))


def load_model(
    folder: str | Path, dtype: torch.dtype, device: torch.device | str, shard: ModelShard | None = None
) -> DeepseekV4Model:
    """Build the model for ``folder`` on ``device`` and fill every weight, or raise naming what is wrong.
    With ``shard``, only this rank's part is built and read."""
    model = build_meta_model(folder, dtype, shard)
    cfg = model.cfg
    model.to_empty(device=device)
    unknown: list[str] = []
    tensors = _tensors(Path(folder))
    if shard is not None:
        tensors = shard.weights(tensors, cfg.n_routed_experts)
    filled = model.load_weights(tensors, unknown)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        raise CheckpointError(f"{folder}: {len(unknown)} tensors the model does not have: {shown}")
    missing = sorted(model.expected_weights() - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensors: {shown}")
    return model.eval()


def build_meta_model(
    folder: str | Path, dtype: torch.dtype, shard: ModelShard | None = None
) -> DeepseekV4Model:
    """The model for ``folder`` (or one rank's part of it) with shapes and dtypes but no memory."""
    raw = read_config(folder)
    config_cls, model_cls = resolve(raw.get("model_type"))
    cfg = config_cls.from_dict(raw)
    mtp_layers = _mtp_layers_present(Path(folder))
    if mtp_layers < cfg.num_nextn_predict_layers:
        # Checkpoints saved by transformers drop the MTP tensors: serve without a draft head.
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=mtp_layers)
    with torch.device("meta"):
        model = model_cls(cfg)
        if shard is not None:
            shard.apply(model)
    model.cast_(dtype)
    return model


def _mtp_layers_present(folder: Path) -> int:
    layers: set[str] = set()
    for f in _files(folder):
        with safe_open(str(f), framework="pt") as sf:
            layers.update(k.split(".")[1] for k in sf.keys() if k.startswith("mtp."))  # noqa: SIM118
    return len(layers)


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


def _tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = _files(folder)
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < _PROGRESS_MIN_BYTES
    )
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            for name in sorted(names):
                if is_scale_tensor(name, names):
                    continue
                tensor = sf.get_tensor(name)
                scale_name = _scale_of(name, names)
                if scale_name is not None:
                    tensor = dequantize(tensor, sf.get_tensor(scale_name))
                yield name, tensor
        bar.update(f.stat().st_size)
    bar.close()


def _scale_of(name: str, names: set[str]) -> str | None:
    if not name.endswith(".weight"):
        return None
    base = name.removesuffix(".weight")
    for suffix in (".scale", ".weight_scale_inv", ".weight_scale"):
        if base + suffix in names:
            return base + suffix
    return None
