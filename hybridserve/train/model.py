"""Trunk (transformers ``DeepseekV4ForCausalLM``) + MTP module, joint loss, and router load balancing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

from hybridserve.train.mtp import MTPModule

IGNORE = -100


@dataclass
class ModelSpec:
    """The architecture knobs we set; everything else keeps the transformers default."""

    vocab_size: int = 4096
    hidden_size: int = 192
    layer_types: list[str] = field(
        default_factory=lambda: [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ]
    )
    mlp_layer_types: list[str] = field(default_factory=lambda: ["hash_moe", "moe", "moe", "moe"])
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 160
    num_attention_heads: int = 4
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    q_lora_rank: int = 96
    o_groups: int = 2
    o_lora_rank: int = 64
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 16
    sliding_window: int = 64
    csa_rate: int = 4
    hca_rate: int = 16
    hc_mult: int = 2
    max_position_embeddings: int = 4096

    def to_config(self, bos_id: int, eos_id: int, pad_id: int) -> DeepseekV4Config:
        kwargs: dict[str, Any] = asdict(self)
        rates = {
            "compressed_sparse_attention": kwargs.pop("csa_rate"),
            "heavily_compressed_attention": kwargs.pop("hca_rate"),
        }
        return DeepseekV4Config(
            **kwargs,
            num_hidden_layers=len(self.layer_types),
            compress_rates=rates,
            num_nextn_predict_layers=1,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            tie_word_embeddings=False,
        )


PRESETS: dict[str, ModelSpec] = {
    "small": ModelSpec(),
    "tiny": ModelSpec(
        vocab_size=512,
        hidden_size=32,
        n_routed_experts=4,
        moe_intermediate_size=32,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=16,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        sliding_window=8,
        max_position_embeddings=512,
    ),
}


def fill_hash_routing(model: nn.Module, seed: int) -> None:
    """Fill every ``tid2eid`` with a fixed random table: each token row gets distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, DeepseekV4HashRouter):
            vocab, top_k = module.tid2eid.shape
            rows = torch.rand(vocab, module.num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
            module.tid2eid.copy_(rows.to(module.tid2eid.dtype))


def build_models(config: DeepseekV4Config, seed: int) -> tuple[DeepseekV4ForCausalLM, MTPModule]:
    torch.manual_seed(seed)
    trunk = DeepseekV4ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    mtp = MTPModule(config)
    with torch.no_grad():
        for module in mtp.modules():
            # same initialisation scheme as the trunk's layers (normal(0.02), unit norms, zero sinks, ...)
            trunk._init_weights(module)
        fill_hash_routing(trunk, seed)
    return trunk, mtp


class StreamCatcher:
    """Captures the input of ``model.model.hc_head``: the pre-head residual streams [B, S, hc, D]."""

    def __init__(self, trunk: DeepseekV4ForCausalLM) -> None:
        self.streams: torch.Tensor | None = None
        self.handle = trunk.model.hc_head.register_forward_pre_hook(self._hook)

    def _hook(self, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.streams = args[0]

    def pop(self) -> torch.Tensor:
        if self.streams is None:
            raise RuntimeError("the trunk forward did not reach hc_head")
        streams, self.streams = self.streams, None
        return streams


@dataclass
class Losses:
    main: torch.Tensor
    mtp: torch.Tensor
    total: torch.Tensor


class JointModel(nn.Module):
    """Trunk + MTP trained together: loss = CE(next token) + mtp_weight * CE(token after next)."""

    def __init__(self, trunk: DeepseekV4ForCausalLM, mtp: MTPModule, mtp_weight: float) -> None:
        super().__init__()
        self.trunk = trunk
        self.mtp = mtp
        self.mtp_weight = mtp_weight
        self.catcher = StreamCatcher(trunk)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (main logits [B, S, V] for t+1, MTP logits [B, S-1, V] for t+2)."""
        logits = self.trunk(input_ids=ids, use_cache=False).logits
        streams = self.catcher.pop()
        mtp_logits = self.mtp(streams[:, :-1], ids[:, 1:], self.trunk.model.embed_tokens, self.trunk.lm_head)
        return logits, mtp_logits

    def losses(self, ids: torch.Tensor) -> Losses:
        logits, mtp_logits = self(ids)
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        # MTP position t predicts ids[t+2]; the last MTP position has no target.
        mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
        return Losses(main, mtp, main + self.mtp_weight * mtp)


class RouterBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3 style) of top-k routers.

    Counts each top-k router's expert picks during a step, then nudges ``e_score_correction_bias``
    by ``speed * sign(mean_load - load)``: overloaded experts become less likely to be picked.
    """

    def __init__(self, modules: list[nn.Module], speed: float) -> None:
        self.speed = speed
        self.routers = [m for root in modules for m in root.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.handles = [r.register_forward_hook(self._make_hook(i)) for i, r in enumerate(self.routers)]
        self.last_imbalance = 0.0

    def _make_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> None:
            if module.training:
                picked = output[2].detach().flatten()
                self.counts[index] += torch.bincount(picked, minlength=len(self.counts[index])).float()

        return hook

    @torch.no_grad()
    def step(self) -> None:
        self.last_imbalance = self._imbalance()
        for router, counts in zip(self.routers, self.counts, strict=True):
            bias = router.e_score_correction_bias
            if counts.sum() > 0 and isinstance(bias, torch.Tensor):
                bias.add_(self.speed * torch.sign(counts.mean() - counts))
            counts.zero_()

    def _imbalance(self) -> float:
        """Worst max/mean expert load over the routers in the counted step (1.0 = perfect)."""
        worst = 0.0
        for counts in self.counts:
            if counts.sum() > 0:
                worst = max(worst, float(counts.max() / counts.mean()))
        return worst


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
