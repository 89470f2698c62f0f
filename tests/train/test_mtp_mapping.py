"""MTP module: on-disk naming (round trip + agreement with ``save_pretrained``) and causality."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV4ForCausalLM

from hybridserve.train.model import PRESETS
from hybridserve.train.mtp import (
    MTPModule,
    layer_state_from_disk,
    layer_state_to_disk,
    mtp_state_from_disk,
    mtp_state_to_disk,
)

OWN_NAMES = {
    "mtp.0.e_proj.weight",
    "mtp.0.h_proj.weight",
    "mtp.0.enorm.weight",
    "mtp.0.hnorm.weight",
    "mtp.0.norm.weight",
    "mtp.0.hc_head_fn",
    "mtp.0.hc_head_base",
    "mtp.0.hc_head_scale",
}


@pytest.fixture(scope="module")
def config():  # type: ignore[no-untyped-def]
    return PRESETS["tiny"].to_config(bos_id=0, eos_id=1, pad_id=2)


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Every floating tensor random (norms, sinks, biases included) so a swapped name cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)


def test_mtp_round_trip(config) -> None:  # type: ignore[no-untyped-def]
    mtp = MTPModule(config)
    randomize(mtp)
    disk = mtp_state_to_disk(mtp)
    assert set(disk) >= OWN_NAMES
    for name in (
        "attn.wq_a.weight",
        "attn.attn_sink",
        "attn_norm.weight",
        "ffn.gate.weight",
        "ffn.gate.bias",
    ):
        assert f"mtp.0.{name}" in disk
    assert "mtp.0.ffn.experts.0.w1.weight" in disk
    assert "mtp.0.hc_attn_fn" in disk
    assert all(k.startswith("mtp.0.") for k in disk)

    fresh = MTPModule(config)
    state = mtp_state_from_disk(fresh, {"model.norm.weight": torch.ones(1), **disk})
    original = mtp.state_dict()
    assert set(state) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_block_names_match_save_pretrained(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Our layer naming is exactly what ``save_pretrained`` writes, for every attention / MoE type."""
    model = DeepseekV4ForCausalLM(config)
    randomize(model)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        on_disk = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
        ours = layer_state_to_disk(layer.state_dict())
        assert set(ours) == set(on_disk), config.layer_types[index]
        for key, value in ours.items():
            torch.testing.assert_close(value, on_disk[key], rtol=0, atol=0)
        back = layer_state_from_disk(on_disk, layer.state_dict())
        for key, value in layer.state_dict().items():
            torch.testing.assert_close(back[key], value, rtol=0, atol=0)


def test_mtp_is_causal(config) -> None:  # type: ignore[no-untyped-def]
    """MTP logits at position t may depend on streams <= t and tokens <= t+1 only."""
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).eval()
    mtp = MTPModule(config).eval()
    randomize(mtp)
    length, cut = 24, 10
    streams = torch.randn(1, length, config.hc_mult, config.hidden_size)
    next_ids = torch.randint(5, config.vocab_size, (1, length))
    with torch.no_grad():
        base = mtp(streams, next_ids, model.model.embed_tokens, model.lm_head)
        streams[:, cut + 1 :] += 1.0
        next_ids[:, cut + 1 :] = (next_ids[:, cut + 1 :] + 7) % config.vocab_size
        changed = mtp(streams, next_ids, model.model.embed_tokens, model.lm_head)
    assert base.shape == (1, length, config.vocab_size)
    torch.testing.assert_close(changed[:, : cut + 1], base[:, : cut + 1])
    assert not torch.allclose(changed[:, cut + 1 :], base[:, cut + 1 :])
