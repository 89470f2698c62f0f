"""Quantized checkpoints in DeepSeek's layout: what config.json declares, which tensors are quantized, and
the model's modules that keep them so (FP8 e4m3 with 128x128 block scales; FP4 e2m1 routed experts with
ue8m0 scales per 32 values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridserve.layers.moe import Experts
from hybridserve.layers.quantized_experts import QuantizedExperts
from hybridserve.layers.quantized_linear import QuantLinear
from hybridserve.layers.quantized_weight import E8M0, FP4, dequantize, weight_format

SCALE_SUFFIXES = (".scale", ".weight_scale_inv", ".weight_scale")
QUANT_METHODS = ("fp8",)
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    **({"F8_E8M0": E8M0} if E8M0 is not None else {}),
    **({"F4": torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2") else {}),
}


def check_quantization_config(raw: dict[str, Any]) -> None:
    """config.json's ``quantization_config``: absent, or DeepSeek's FP8 (e4m3) method; else ValueError."""
    qc = raw.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"config.json: unknown quantization method {method!r} in quantization_config "
            f"(hybridserve reads {', '.join(QUANT_METHODS)}: DeepSeek's FP8 e4m3 block-scaled weights, "
            "optionally with FP4 experts; dequantise the checkpoint to bfloat16 to serve it otherwise)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json: quantization_config fmt {qc['fmt']!r} is not supported (only e4m3)")


def is_scale_tensor(name: str, names: set[str]) -> bool:
    """True for a scale that belongs to a quantised ``.weight`` next to it."""
    return any(name.endswith(s) and name.removesuffix(s) + ".weight" in names for s in SCALE_SUFFIXES)


def scale_of(name: str, names: set[str]) -> str | None:
    """The scale tensor of weight ``name``, if it has one."""
    if not name.endswith(".weight"):
        return None
    base = name.removesuffix(".weight")
    return next((base + s for s in SCALE_SUFFIXES if base + s in names), None)


def scale_name(weight_name: str) -> str:
    """The name hybridserve loads a weight's scale under (and ``quantize`` writes): ``X.scale``."""
    return weight_name.removesuffix(".weight") + ".scale"


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight as stored: format, dtypes and shapes (torch's, FP4 packed two per byte)."""

    fmt: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    scale_dtype: torch.dtype
    scale_shape: tuple[int, ...]


def header(slice_: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    """(torch dtype, torch shape) of a safetensors slice, without reading it."""
    kind, shape = slice_.get_dtype(), tuple(slice_.get_shape())
    if kind not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {kind}")
    if kind == "F4":  # safetensors counts 4-bit values; torch's float4_e2m1fn_x2 holds two
        shape = (*shape[:-1], shape[-1] // 2)
    return _SAFETENSORS_DTYPES[kind], shape


def quantized_tensor(
    weight: tuple[torch.dtype, tuple[int, ...]], scale: tuple[torch.dtype, tuple[int, ...]]
) -> QuantizedTensor:
    fmt = weight_format(torch.empty(0, dtype=weight[0]))
    dtype = torch.uint8 if fmt == FP4 else weight[0]  # packed e2m1 is held as bytes
    return QuantizedTensor(fmt, dtype, weight[1], scale[0], scale[1])


@dataclass(frozen=True)
class QuantizedModule:
    """Where a quantized checkpoint tensor goes: a linear (``path``) or one expert's w1/w2/w3."""

    path: str
    expert: int | None
    which: str | None


def keep_quantized_(
    model: nn.Module, tensors: dict[QuantizedModule, QuantizedTensor], dtype: torch.dtype
) -> set[QuantizedModule]:
    """Swap each linear and expert stack that ``tensors`` covers for its quantized form (on the meta
    device, before weights are allocated). -> the entries that stay quantized; the others (a quantized
    tensor of a module without a quantized form) are dequantised at load."""
    kept: set[QuantizedModule] = set()
    experts: dict[str, dict[tuple[int, str], QuantizedTensor]] = {}
    for where, t in tensors.items():
        if where.expert is not None:
            experts.setdefault(where.path, {})[(where.expert, where.which or "w2")] = t
            continue
        module = _submodule(model, where.path)
        if isinstance(module, nn.Linear) and module.bias is None:
            _replace(model, where.path, _quant_linear(module, t))
            kept.add(where)
    for path, parts in experts.items():
        module = _submodule(model, path)
        if isinstance(module, Experts) and (stack := _quantized_experts(module, path, parts, dtype)):
            _replace(model, path, stack)
            kept.update(QuantizedModule(path, e, None if w == "w2" else w) for e, w in parts)
    return kept


def _quant_linear(module: nn.Linear, t: QuantizedTensor) -> QuantLinear:
    layer = QuantLinear(module.in_features, module.out_features, t.fmt, t.dtype, t.scale_shape, t.scale_dtype)
    if tuple(layer.weight.shape) != t.shape:
        raise ValueError(f"shape {t.shape}, expected {tuple(layer.weight.shape)} for {t.fmt}")
    return layer


def _quantized_experts(
    module: Experts, path: str, parts: dict[tuple[int, str], QuantizedTensor], dtype: torch.dtype
) -> QuantizedExperts | None:
    """The quantized stack, if every expert's w1, w2 and w3 are quantized alike; else None (dequantised)."""
    n = module.gate_up.shape[0]
    if set(parts) != {(e, w) for e in range(n) for w in ("w1", "w2", "w3")}:
        return None
    w1, w2 = parts[(0, "w1")], parts[(0, "w2")]
    for (_, w), t in parts.items():
        ref = w2 if w == "w2" else w1
        if t != ref:
            raise ValueError(f"{path}: expert weights {w} are quantized unlike expert 0's ({t} vs {ref})")
    if w1.dtype != w2.dtype:
        raise ValueError(f"{path}: w1/w3 are {w1.dtype} but w2 is {w2.dtype}")
    scales = ((w1.scale_shape, w1.scale_dtype), (w2.scale_shape, w2.scale_dtype))
    stack = QuantizedExperts(n, module.hidden, module.inter, module.limit, w1.fmt, w1.dtype, scales, dtype)
    expected = (tuple(stack.gate_up.shape[1:]), tuple(stack.down.shape[1:]))
    if (expected[0][0] // 2, expected[0][1]) != w1.shape or expected[1] != w2.shape:
        raise ValueError(
            f"{path}: expert weights of shape {w1.shape}/{w2.shape}, expected {expected} for {w1.fmt}"
        )
    return stack


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


__all__ = [
    "QuantizedModule",
    "QuantizedTensor",
    "check_quantization_config",
    "dequantize",
    "header",
    "is_scale_tensor",
    "keep_quantized_",
    "quantized_tensor",
    "scale_name",
    "scale_of",
]
