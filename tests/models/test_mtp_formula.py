"""The paged MTP layer against the published MTP formula, written out here from on-disk tensors.

    logits[t] = head(norm(hc_head(block(h_proj(hnorm(h[t])) + e_proj(enorm(embed(tok[t+1])))))))

``h[t]`` are the reference trunk's residual streams (before its hc_head) and ``block`` one sliding-window,
top-k MoE decoder layer at positions 0, 1, ... . The block, its hc_head and norm are a one-layer
transformers model, saved by transformers; its tensors become ``mtp.0.*`` by a plain prefix swap. The
rest of the formula (the two RMSNorms and projections) is computed here, so neither our loader's nor our
training code's name mapping takes part.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.models.loader import load_model
from tests.models.test_mtp import _batch
from tests.reference import reference_model
from tests.tiny_models import VOCAB, randomise

BLOCK = 8


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _block_model(trunk: Any, seed: int) -> Any:
    """A one-layer transformers model whose layer, hc_head and norm are the MTP's; the trunk's head."""
    from transformers import DeepseekV4ForCausalLM

    cfg = copy.deepcopy(trunk.config)
    cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 1, ["sliding_attention"], ["moe"]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    randomise(model, seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(trunk.lm_head.weight)
        model.model.embed_tokens.weight.copy_(trunk.model.embed_tokens.weight)
    return model.eval()


def _mtp_tensors(block_folder: Path, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mtp.0.*`` from the one-layer checkpoint's on-disk names, by prefix alone."""
    out = {f"mtp.0.{k}": v for k, v in own.items()}
    for key, value in load_file(str(block_folder / "model.safetensors")).items():
        if key.startswith("model.layers.0."):
            out["mtp.0." + key.removeprefix("model.layers.0.")] = value
        elif key.startswith("model.hc_head.hc_"):
            out["mtp.0.hc_head_" + key.removeprefix("model.hc_head.hc_")] = value
        elif key == "model.norm.weight":
            out["mtp.0.norm.weight"] = value
    return out


def _own_tensors(dim: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "enorm.weight": 1 + 0.3 * torch.randn(dim, generator=g),
        "hnorm.weight": 1 + 0.3 * torch.randn(dim, generator=g),
        "e_proj.weight": 0.2 * torch.randn(dim, dim, generator=g),
        "h_proj.weight": 0.2 * torch.randn(dim, dim, generator=g),
    }


def _trunk_streams(trunk: Any, ids: list[int]) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    hook = trunk.model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        trunk(torch.tensor([ids]))
    finally:
        hook.remove()
    return captured[0]


def _formula(trunk: Any, block: Any, own: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    eps = trunk.config.rms_norm_eps
    h = _rms_norm(_trunk_streams(trunk, ids)[:, :-1], own["hnorm.weight"], eps) @ own["h_proj.weight"].T
    e = _rms_norm(trunk.model.embed_tokens(torch.tensor([ids[1:]])), own["enorm.weight"], eps)
    x = h + (e @ own["e_proj.weight"].T).unsqueeze(-2)

    def feed_x(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (x, *args[1:]), kwargs

    hook = block.model.layers[0].register_forward_pre_hook(feed_x, with_kwargs=True)
    try:  # the embeddings fed here only set the length and positions; the layer sees x
        return block(inputs_embeds=torch.zeros(1, len(ids) - 1, x.shape[-1])).logits[0]
    finally:
        hook.remove()


def test_paged_mtp_equals_the_formula(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_checkpoint("mixed")
    trunk = reference_model(src)
    block = _block_model(trunk, seed=5)
    block.save_pretrained(tmp_path / "block")
    own = _own_tensors(trunk.config.hidden_size, seed=6)
    shutil.copytree(src, tmp_path / "with_mtp")
    tensors = load_file(str(src / "model.safetensors")) | _mtp_tensors(tmp_path / "block", own)
    save_file(tensors, str(tmp_path / "with_mtp" / "model.safetensors"))

    model = load_model(tmp_path / "with_mtp", torch.float32, "cpu")
    assert len(model.mtp) == 1
    plan = build_plan(model.cache_specs(include_mtp=True), BLOCK, 2, 64, num_blocks=32)
    pools = BlockPoolSet(plan, "cpu")
    coord = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert coord.allocate("r", 0, len(ids))
    tables = coord.block_tables("r")
    with torch.no_grad():
        streams = model(_batch(ids, range(len(ids)), tables, BLOCK), pools.tensors())
        got = []  # a prefill chunk, two single-token (decode) steps past the window, then the rest
        for lo, hi in ((0, 11), (11, 12), (12, 13), (13, 29)):
            batch = _batch(ids[lo + 1 : hi + 1], range(lo, hi), tables, BLOCK)
            mtp = model.mtp_forward(streams[lo:hi], batch, pools.tensors())
            got.append(model.mtp_logits(mtp))
        expected = _formula(trunk, block, own, ids)
    assert trunk.config.sliding_window < 11  # the window matters
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-5, rtol=0)
