"""``hybridserve quantize``: a full-precision checkpoint -> DeepSeek's quantized layout.

``fp8``: every linear's weight as float8_e4m3fn with a ue8m0 scale per 128x128 block (``X.scale``),
routed experts included. ``fp4-experts``: the same, with the routed experts as e2m1 packed two per
byte (int8) with a ue8m0 scale per 32 values: DeepSeek-V4's own release format. As DeepSeek does, the
compressors' and the indexer's scoring projections and the LM head stay in full precision.
config.json gains the ``quantization_config`` (and ``expert_dtype``) the loader reads back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hybridserve.layers.quantized_weight import FP4, FP8, FP8_BLOCK, quantize_fp4, quantize_fp8
from hybridserve.models.deepseek_v4 import DeepseekV4Model, checkpoint_to_param
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from hybridserve.models.loader import CheckpointError, read_config
from hybridserve.models.quant import scale_name

MODES = ("fp8", "fp4-experts")
_FULL_PRECISION = ("compressor.wkv", "compressor.wgate", "weights_proj")


@dataclass
class QuantizeReport:
    quantized: int
    kept: int
    bytes_in: int
    bytes_out: int


def quantize_checkpoint(src: str | Path, out: str | Path, weights: str) -> QuantizeReport:
    """Write ``src`` quantized as ``weights`` (one of MODES) into the new folder ``out``."""
    src, out = Path(src), Path(out)
    if weights not in MODES:
        raise ValueError(f"--weights {weights!r}: choose one of {', '.join(MODES)}")
    raw = read_config(src)
    if raw.get("quantization_config"):
        raise CheckpointError(f"{src}: already quantized ({raw['quantization_config']})")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty (choose a new folder)")
    with torch.device("meta"):
        model = DeepseekV4Model(DeepseekV4Config.from_dict(raw))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy2(f, out / f.name)
    report = QuantizeReport(0, 0, 0, 0)
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = _quantized_file(model, f, weights, report)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f.name))
        report.bytes_in += f.stat().st_size
        report.bytes_out += (out / f.name).stat().st_size
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(_quantized_config(raw, weights), indent=2) + "\n")
    return report


def _quantized_config(raw: dict, weights: str) -> dict:
    config = dict(raw)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    if weights == "fp4-experts":
        config["expert_dtype"] = "fp4"
    return config


def _quantized_file(
    model: nn.Module, f: Path, weights: str, report: QuantizeReport
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(f), framework="pt") as sf:
        for name in sf.keys():  # noqa: SIM118
            tensor = sf.get_tensor(name)
            fmt = _format_for(model, name, tensor, weights)
            if fmt is None:
                tensors[name] = tensor.contiguous()
                report.kept += 1
                continue
            q, scale = quantize_fp4(tensor) if fmt == FP4 else quantize_fp8(tensor)
            tensors[name], tensors[scale_name(name)] = q, scale
            report.quantized += 1
    return tensors


def _format_for(model: nn.Module, name: str, tensor: torch.Tensor, weights: str) -> str | None:
    """FP8 or FP4 for a weight ``quantize`` stores quantized; None to keep it as it is."""
    if not name.endswith(".weight") or tensor.dim() != 2 or not tensor.is_floating_point():
        return None
    param, expert, _ = checkpoint_to_param(name)
    if expert is not None:
        return FP4 if weights == "fp4-experts" else FP8
    path = param.removesuffix(".weight")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(module, nn.Linear) or path == "head" or path.endswith(_FULL_PRECISION):
        return None
    return FP8
