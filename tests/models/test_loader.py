"""Checkpoint loading: names of both layouts, clear errors, FP8 / FP4 dequantisation."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.models.deepseek_v4 import checkpoint_to_param
from hybridserve.models.loader import CheckpointError, load_model
from hybridserve.models.quant import dequantize


def _copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_and_unknown_tensors_are_named(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_checkpoint("mixed")
    missing = _copy(
        src,
        tmp_path / "missing",
        lambda t: {k: v for k, v in t.items() if k != "model.layers.1.attn.indexer.wq_b.weight"},
    )
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors: layers\.1\.attn\.indexer\.wq_b\.weight"):
        load_model(missing, torch.float32, "cpu")
    extra = _copy(src, tmp_path / "extra", lambda t: t | {"model.layers.0.attn.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"does not have: model\.layers\.0\.attn\.bogus"):
        load_model(extra, torch.float32, "cpu")


def test_official_layout_names_map_like_transformers_names() -> None:
    assert checkpoint_to_param("embed.weight") == ("embed_tokens.weight", None, None)
    assert checkpoint_to_param("hc_head_fn") == ("hc_head.hc_fn", None, None)
    assert checkpoint_to_param("model.layers.3.hc_ffn_scale") == ("layers.3.hc_ffn.scale", None, None)
    assert checkpoint_to_param("layers.2.ffn.experts.5.w3.weight") == (
        "layers.2.ffn.experts.gate_up",
        5,
        "w3",
    )
    assert checkpoint_to_param("mtp.0.hc_head_base") == ("mtp.0.hc_head.hc_base", None, None)
    assert checkpoint_to_param("mtp.0.e_proj.weight") == ("mtp.0.e_proj.weight", None, None)
    assert checkpoint_to_param("mtp.0.attn.wkv.weight") == ("mtp.0.block.attn.wkv.weight", None, None)


def test_bf16_load_keeps_the_reference_fp32_parameters(tiny_checkpoint: Callable[[str], Path]) -> None:
    model = load_model(tiny_checkpoint("mixed"), torch.bfloat16, "cpu")
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert "layers.0.attn.attn_sink" in fp32 and "layers.1.attn.compressor.ape" in fp32
    assert "layers.2.hc_attn.fn" in fp32 and "hc_head.hc_fn" in fp32 and "layers.0.attn_norm.weight" in fp32
    assert model.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert model.get_buffer("layers.1.ffn.gate.bias").dtype == torch.float32


def test_fp8_block_dequantisation() -> None:
    w = torch.randn(300, 260) * 0.1
    scale = torch.rand(3, 3) + 0.5
    full = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    q = (w / full).to(torch.float8_e4m3fn)
    expected = (q.float() * full).to(torch.bfloat16)
    assert torch.equal(dequantize(q, scale), expected)


def test_fp4_dequantisation_with_e8m0_scales() -> None:
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    exps = torch.randint(120, 130, (4, 2), dtype=torch.uint8)
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    expected = table[codes.long()] * torch.pow(2.0, exps.float() - 127).repeat_interleave(32, 1)
    assert torch.equal(dequantize(packed, exps.view(torch.float8_e8m0fnu)), expected.to(torch.bfloat16))


def test_transformers_checkpoint_without_mtp_tensors_loads_without_a_draft_head(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    folder = tiny_checkpoint("mixed")
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert len(load_model(folder, torch.float32, "cpu").mtp) == 0
