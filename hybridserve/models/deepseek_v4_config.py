"""DeepSeek-V4 model configuration, parsed from a Hugging Face ``config.json``.

Mirrors what transformers' ``DeepseekV4Config.__post_init__`` derives (layer types, hash layers,
compress rates, the two rope sets) so that checkpoints in either the transformers layout or the
official DeepSeek layout (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``) load alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridserve.layers.rope_config import RopeConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    rope: dict[str, RopeConfig]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rope_head_dim(self) -> int:
        return self.rope["main"].rope_dim

    def compress_rate(self, layer: int) -> int:
        return self.compress_rates.get(self.layer_types[layer], 0)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DeepseekV4Config:
        if cfg.get("model_type") != "deepseek_v4":
            raise ValueError(f"expected model_type 'deepseek_v4', got {cfg.get('model_type')!r}")
        n = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim", 512))
        eos = cfg.get("eos_token_id", 1)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(cfg["num_attention_heads"]),
            head_dim=head_dim,
            q_lora_rank=int(cfg["q_lora_rank"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            n_routed_experts=int(cfg["n_routed_experts"]),
            n_shared_experts=int(cfg.get("n_shared_experts", 1)),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            layer_types=_layer_types(cfg, n),
            mlp_layer_types=_mlp_layer_types(cfg, n),
            compress_rates=_compress_rates(cfg),
            rope=_rope_sets(cfg, head_dim),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            sliding_window=int(cfg.get("sliding_window", 128)),
            o_groups=int(cfg.get("o_groups", 8)),
            o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1 << 20)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            pad_token_id=cfg.get("pad_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            raw=dict(cfg),
        )


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        types = [_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"][:n]]
    if types is None:
        interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        types = [HCA] * min(n, 2) + interleave
    types = list(types)[:n]
    bad = [t for t in types if t not in LAYER_TYPES]
    if len(types) != n or bad:
        raise ValueError(f"layer_types must list {n} entries from {LAYER_TYPES}; got {types}")
    return tuple(types)


def _mlp_layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        n_hash = int(cfg.get("num_hash_layers", 3))
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = list(types)[:n]
    if len(types) != n or any(t not in ("hash_moe", "moe") for t in types):
        raise ValueError(f"mlp_layer_types must list {n} entries from ('hash_moe', 'moe'); got {types}")
    return tuple(types)


def _compress_rates(cfg: dict[str, Any]) -> dict[str, int]:
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    if cfg.get("compress_rate_csa") is not None:
        rates[CSA] = int(cfg["compress_rate_csa"])
    if cfg.get("compress_rate_hca") is not None:
        rates[HCA] = int(cfg["compress_rate_hca"])
    return {k: int(v) for k, v in rates.items()}


def _rope_sets(cfg: dict[str, Any], head_dim: int) -> dict[str, RopeConfig]:
    prf = cfg.get("partial_rotary_factor")
    if prf is None:
        qk_rope = cfg.get("qk_rope_head_dim")
        prf = qk_rope / head_dim if qk_rope is not None else 64 / 512
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    # transformers reads `truncate` from the top level of the nested dict, where it never is.
    truncate = True
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        truncate = bool(rp.get("truncate", True))
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if "type" in yarn and "rope_type" not in yarn:
            yarn["rope_type"] = yarn.pop("type")
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    max_pos = int(cfg.get("max_position_embeddings", 1 << 20))
    return {
        "main": RopeConfig.from_params(main, head_dim, float(prf), max_pos, truncate),
        "compress": RopeConfig.from_params(compress, head_dim, float(prf), max_pos, truncate),
    }
