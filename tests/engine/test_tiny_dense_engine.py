"""The engine serves a second architecture through the registry (``models/tiny_dense.py``): greedy tokens of
concurrent requests (chunked, continuously batched, prefix-cached, preempted) equal a plain non-paged
forward of the same weights, one sequence at a time, written here from the checkpoint's tensors; what
the model does not support is refused at start-up, naming it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hybridserve import LLM, SamplingParams
from hybridserve.models import registry
from hybridserve.models.loader import CheckpointError, ModelShard
from tests.tiny_models import VOCAB

MAX_NEW = 16
CASES = {
    "four_chunked": dict(max_num_seqs=4, max_num_batched_tokens=13),
    "sixteen": dict(max_num_seqs=16, max_num_batched_tokens=48),
    "preempting": dict(
        max_num_seqs=16, max_num_batched_tokens=32, num_blocks=10, enable_prefix_caching=False
    ),
}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """[T, H, D]: channel pairs (2i, 2i + 1) of position p rotated by p * theta^(-2i / D)."""
    d = x.shape[-1]
    angle = torch.arange(x.shape[0]).float()[:, None] * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)


def plain_logits(w: dict[str, torch.Tensor], cfg: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """Every position's logits [T, V] of one sequence: dense causal attention (over the last
    ``sliding_window`` tokens, if set), no cache."""
    t, h, d, eps = len(ids), cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    pos = torch.arange(t)
    allowed = pos[:, None] >= pos[None, :]
    if cfg["sliding_window"] is not None:
        allowed &= pos[:, None] - pos[None, :] < cfg["sliding_window"]
    x = w["embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        y = _rms(x, w[p + "input_norm.weight"], eps)
        q, k, v = (y @ w[p + f"attn.{n}.weight"].T for n in ("wq", "wk", "wv"))
        q, k = _rope(q.view(t, h, d), cfg["rope_theta"]), _rope(k.view(t, h, d), cfg["rope_theta"])
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", attn, v.view(t, h, d)).flatten(1) @ w[p + "attn.wo.weight"].T
        y = _rms(x, w[p + "post_norm.weight"], eps)
        gate, up = y @ w[p + "gate.weight"].T, y @ w[p + "up.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "down.weight"].T
    return _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T


def plain_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    w = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(plain_logits(w, cfg, ids)[-1].argmax()))
    return ids[len(prompt) :]


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 1 to 40 tokens; every third one shares a 20-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]
    return [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts)]


@pytest.mark.parametrize("window", [6, None], ids=["sliding", "full"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_concurrent_greedy_equals_plain_forward(
    tiny_dense_checkpoint: Callable[[int | None], Path], window: int | None, case: str
) -> None:
    folder = tiny_dense_checkpoint(window)
    llm = LLM(str(folder), block_tokens=8, **CASES[case])
    prompts = _prompts(10, seed=3)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)  # a prefix-caching engine now finds the prompts cached
    expected = [plain_greedy(folder, p, MAX_NEW) for p in prompts]
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    if case == "preempting":  # a window cache keeps few blocks per request: only full attention runs out
        assert (llm.engine.scheduler.num_preemptions > 0) == (window is None)
    else:
        assert sum(o.num_cached_tokens for o in second) > 0
    assert llm.engine.runner.steps_by_path.keys() == {"eager"}
    llm.engine.pools.check_integrity()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "needs MTP weights"),
        (dict(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8"),
        (dict(compile_decode=True), "--compile-decode"),
        (dict(compile_prefill=True), "--compile-prefill"),
    ],
    ids=["mtp", "fp8", "compile_decode", "compile_prefill"],
)
def test_unsupported_features_are_refused_at_start_up(
    tiny_dense_checkpoint: Callable[[int | None], Path], flags: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=f"{named}.*tiny_dense"):
        LLM(str(tiny_dense_checkpoint(6)), device="cpu", **flags)


def test_the_registry_loads_by_model_type(tiny_dense_checkpoint: Callable[[int | None], Path]) -> None:
    folder = tiny_dense_checkpoint(6)
    model = registry.load_model(folder, torch.float32, "cpu")
    assert model.info.name == "tiny_dense" and model.info.num_draft_layers == 0
    with pytest.raises(CheckpointError, match="tiny_dense has no routed experts"):
        registry.load_model(folder, torch.float32, "cpu", shard=cast(ModelShard, object()))
    raw = json.loads((folder / "config.json").read_text())
    other = folder.parent / "unknown_type"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text(json.dumps(raw | {"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'llama'.*deepseek_v4.*tiny_dense"):
        registry.load_model(other, torch.float32, "cpu")
