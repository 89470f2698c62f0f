"""Hugging Face folder -> DeepSeek-V4 model with weights (safetensors; FP8/FP4 weights stay quantized, or are
dequantised at load with ``keep_quantized=False``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from hybridserve.layers.quantized_linear import QuantLinear
from hybridserve.layers.weight_layout import input_major_
from hybridserve.models.deepseek_v4 import DeepseekV4Model, checkpoint_to_param
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from hybridserve.models.quant import (
    QuantizedModule,
    QuantizedTensor,
    check_quantization_config,
    dequantize,
    header,
    is_scale_tensor,
    keep_quantized_,
    quantized_tensor,
    scale_name,
    scale_of,
)

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
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_quantized: bool = True,
    native_fp8: bool = False,
    shard: ModelShard | None = None,
) -> DeepseekV4Model:
    """Build the model for ``folder`` on ``device`` and fill every weight, or raise naming what is wrong.

    FP8 / FP4 weights of linears and routed experts stay quantized in memory (dequantised per layer at
    use) unless ``keep_quantized`` is False; other quantized tensors are dequantised here. With
    ``native_fp8``, FP8 linears multiply natively where the device supports it (CUDA sm90+). With
    ``shard``, only this rank's part is built and read (quantized weights are then dequantised at load).
    """
    model, cfg = _meta_model(folder, shard)
    resident = _keep_quantized(model, Path(folder), dtype) if keep_quantized and shard is None else set()
    model.cast_(dtype)
    model.to_empty(device=device)
    unknown: list[str] = []
    tensors = _tensors(Path(folder), resident)
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
    if dtype == torch.float32:
        input_major_(model, skip={m.path for m, _ in _quantized_tensors(Path(folder)).values()})
    if native_fp8:
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.enable_native_fp8()
    return model.eval()


def build_meta_model(
    folder: str | Path, dtype: torch.dtype, shard: ModelShard | None = None
) -> DeepseekV4Model:
    """The model for ``folder`` (or one rank's part of it) with shapes and dtypes but no memory."""
    model, _ = _meta_model(folder, shard)
    model.cast_(dtype)
    return model


def _meta_model(folder: str | Path, shard: ModelShard | None) -> tuple[DeepseekV4Model, DeepseekV4Config]:
    raw = read_config(folder)
    try:
        check_quantization_config(raw)
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None
    if raw.get("model_type") != "deepseek_v4":
        raise CheckpointError(f"{folder}: model_type {raw.get('model_type')!r} is not deepseek_v4")
    cfg = DeepseekV4Config.from_dict(raw)
    mtp_layers = _mtp_layers_present(Path(folder))
    if mtp_layers < cfg.num_nextn_predict_layers:
        # Checkpoints saved by transformers drop the MTP tensors: serve without a draft head.
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=mtp_layers)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
        if shard is not None:
            shard.apply(model)
    return model, cfg


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


def _keep_quantized(model: DeepseekV4Model, folder: Path, dtype: torch.dtype) -> set[str]:
    """Give the model quantized modules for the checkpoint's quantized tensors. -> their names."""
    found = _quantized_tensors(folder)
    try:
        kept = keep_quantized_(model, dict(found.values()), dtype)
    except ValueError as exc:
        raise CheckpointError(f"{folder}: {exc}") from None
    return {name for name, (where, _) in found.items() if where in kept}


def _quantized_tensors(folder: Path) -> dict[str, tuple[QuantizedModule, QuantizedTensor]]:
    """Every weight with a scale next to it, read from the file headers: where it goes, how it is stored."""
    found: dict[str, tuple[QuantizedModule, QuantizedTensor]] = {}
    for f in _files(folder):
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            for name in sorted(names):
                scale = scale_of(name, names)
                if scale is None:
                    continue
                try:
                    t = quantized_tensor(header(sf.get_slice(name)), header(sf.get_slice(scale)))
                except ValueError as exc:
                    raise CheckpointError(f"{folder}: {name}: {exc}") from None
                param, expert, which = checkpoint_to_param(name)
                path = param.removesuffix(".weight") if expert is None else param.rpartition(".")[0]
                found[name] = (QuantizedModule(path, expert, which if expert is not None else None), t)
    return found


def _tensors(folder: Path, resident: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
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
                yield from _weight(folder, name, sf, scale_of(name, names), name in resident)
        bar.update(f.stat().st_size)
    bar.close()


def _weight(
    folder: Path, name: str, sf: Any, scale: str | None, resident: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint weight as the model takes it: raw with its scale (resident), dequantised, or plain."""
    tensor = sf.get_tensor(name)
    if scale is None:
        if tensor.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{folder}: {name} is float8_e4m3fn but has no scale tensor next to it")
        yield name, tensor
    elif resident:
        yield name, tensor if tensor.dtype == torch.float8_e4m3fn else tensor.view(torch.uint8)  # packed FP4
        yield scale_name(name), sf.get_tensor(scale)
    else:
        try:
            yield name, dequantize(tensor, sf.get_tensor(scale))
        except ValueError as exc:
            raise CheckpointError(f"{folder}: {name}: {exc}") from None
