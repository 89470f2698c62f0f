"""fp32 CPU checkpoints load with their matmul weights input-major: same values, same shapes, every
linear and expert stack's transpose contiguous; bf16 keeps the checkpoint's layout (its bit-exact
parity with the reference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hybridserve.layers.moe import Experts
from hybridserve.layers.weight_layout import input_major_
from hybridserve.models.loader import load_model


def _matmul_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[f"{name}.weight"] = m.weight
        elif isinstance(m, Experts):
            out[f"{name}.gate_up"], out[f"{name}.down"] = m.gate_up, m.down
    return out


def test_fp32_weights_load_input_major(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    fp32, bf16 = load_model(folder, torch.float32, "cpu"), load_model(folder, torch.bfloat16, "cpu")
    weights, kept = _matmul_weights(fp32), _matmul_weights(bf16)
    assert len(weights) > 10 and weights.keys() == kept.keys()
    for name, w in weights.items():
        assert w.transpose(-1, -2).is_contiguous() and not w.is_contiguous(), name
        assert kept[name].is_contiguous(), name
        assert w.shape == kept[name].shape
        torch.testing.assert_close(w.bfloat16(), kept[name], rtol=0, atol=0)  # same checkpoint values
    assert input_major_(bf16) == 0  # nothing float32 to re-store


def test_input_major_keeps_values_and_results() -> None:
    layer = nn.Linear(48, 40, bias=False)
    x = torch.randn(5, 48)
    before, expected = layer.weight.detach().clone(), layer(x)
    assert input_major_(layer) == 1
    assert torch.equal(layer.weight, before) and layer.weight.mT.is_contiguous()
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
