"""Float32 matmul weights stored input-major on CPU.

``F.linear(x, W)`` multiplies by ``W.T``. With W [out, in] row-major (the checkpoint's layout) MKL's
fp32 GEMM reads a transposed operand; with W's storage input-major (``W.T`` contiguous) it streams a
plain row-major one, 1.1-2.5x faster at 1-16 rows and no slower at 512 on this machine (measured in
``benchmarks/README.md``). Parameters keep their shapes and names; only their strides change, so
loading, sharding and every caller are untouched. bf16 weights, and weights stored quantized in the
checkpoint (resident or dequantised at load, which must give the same bits), keep the checkpoint's
layout: the bf16 path repeats the reference's roundings bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from hybridserve.layers.moe import Experts


def input_major_(model: nn.Module, skip: Collection[str] = ()) -> int:
    """Re-store every plain float32 CPU linear and routed-expert stack input-major, except the modules
    named in ``skip`` -> how many."""
    count = 0
    for name, module in model.named_modules():
        if name in skip:
            continue
        for p in _matmul_weights(module):
            if p.device.type == "cpu" and p.dtype == torch.float32 and not getattr(p, "quantized", False):
                p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)
                count += 1
    return count


def _matmul_weights(module: nn.Module) -> list[torch.Tensor]:
    if isinstance(module, nn.Linear):
        return [module.weight]
    if isinstance(module, Experts):
        return [module.gate_up, module.down]
    return []
