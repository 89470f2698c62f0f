"""DeepSeek-V4 multi-token-prediction (MTP) module for training, in the official checkpoint layout.

Given the main model's pre-``hc_head`` residual streams ``h[t]`` ([B, S, hc_mult, D]) and token ``t+1``,
predict token ``t+2``:

    e = enorm(embed(tok[t+1]));  h = hnorm(h[t])
    x = h_proj(h) + e_proj(e)[..., None, :]          # [B, S', hc_mult, D]
    x = block(x)                                     # one V4 decoder layer: sliding window, top-k MoE
    logits = head(norm(hc_head(x)))                  # own HyperHead + RMSNorm, shared output head

The block runs over the MTP positions as their own sequence (RoPE positions 0..S'-1 = position of ``h[t]``).
On disk every tensor lives under ``mtp.0.``; the block's tensors carry exactly the suffixes
``save_pretrained`` gives a main-model layer (``attn.wq_a.weight``, ``ffn.experts.E.w1.weight``, ...).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
)

MTP_PREFIX = "mtp.0."

# In-memory suffix of a decoder layer's tensor -> on-disk suffix, as `save_pretrained` writes it.
# Ordered: more specific patterns first; applied once each, left to right, on the full suffix.
_LAYER_TO_DISK: tuple[tuple[str, str], ...] = (
    (r"^mlp\.shared_experts\.gate_proj\.", "ffn.shared_experts.w1."),
    (r"^mlp\.shared_experts\.down_proj\.", "ffn.shared_experts.w2."),
    (r"^mlp\.shared_experts\.up_proj\.", "ffn.shared_experts.w3."),
    (r"^self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"^self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"^self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"^self_attn\.", "attn."),
    (r"^mlp\.", "ffn."),
    (r"^input_layernorm\.", "attn_norm."),
    (r"^post_attention_layernorm\.", "ffn_norm."),
    (r"^attn_hc\.(fn|base|scale)$", r"hc_attn_\1"),
    (r"^ffn_hc\.(fn|base|scale)$", r"hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
)
# MTP-level parameters outside the block: in-memory name -> on-disk name (without the prefix).
_MTP_OWN_TO_DISK = {
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_EXPERTS_RE = re.compile(r"^(ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def mtp_block_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """A copy of the trunk config whose single layer is a sliding-window, top-k MoE layer."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["sliding_attention"]
    cfg.mlp_layer_types = ["moe"]
    return cfg


def sliding_causal_bias(length: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [1, 1, S, S] mask: query i sees keys j with 0 <= i - j < window (as transformers' mask)."""
    pos = torch.arange(length, device=device)
    delta = pos[:, None] - pos[None, :]
    allowed = (delta >= 0) & (delta < window)
    bias = torch.zeros(length, length, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, float("-inf"))[None, None]


class MTPModule(nn.Module):
    """One MTP depth. ``embed`` and ``head`` are the main model's, passed in at call time (shared)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = mtp_block_config(config)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV4RMSNorm(dim, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(dim, eps=eps)
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.block = DeepseekV4DecoderLayer(self.config, layer_idx=0)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.norm = DeepseekV4RMSNorm(dim, eps=eps)
        self.rotary_emb = DeepseekV4RotaryEmbedding(self.config)

    def forward(
        self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding, head: nn.Linear
    ) -> torch.Tensor:
        """streams: [B, S, hc, D] at positions t; next_ids: [B, S] = tokens t+1. Returns logits for t+2."""
        batch, length = next_ids.shape
        e = self.enorm(embed(next_ids))
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(e).unsqueeze(-2)
        position_ids = torch.arange(length, device=x.device).unsqueeze(0).expand(batch, -1)
        rope = {
            kind: self.rotary_emb(x, position_ids=position_ids, layer_type=kind)
            for kind in ("main", "compress")
        }
        mask = sliding_causal_bias(length, self.config.sliding_window, x.dtype, x.device)
        x = self.block(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask)
        return head(self.norm(self.hc_head(x)))


def layer_key_to_disk(key: str) -> str:
    """On-disk suffix of one in-memory decoder-layer key (not for the packed expert tensors)."""
    for pattern, repl in _LAYER_TO_DISK:
        key = re.sub(pattern, repl, key)
    return key


def layer_state_to_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder layer's in-memory state dict -> on-disk suffixes (experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "mlp.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)  # [E, 2I, D]: gate rows first, then up
            for e in range(value.shape[0]):
                out[f"ffn.experts.{e}.w1.weight"] = gate[e].contiguous()
                out[f"ffn.experts.{e}.w3.weight"] = up[e].contiguous()
        elif key == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                out[f"ffn.experts.{e}.w2.weight"] = value[e].contiguous()
        else:
            out[layer_key_to_disk(key)] = value
    return out


def _invert(disk_key: str, names: dict[str, str]) -> str:
    if disk_key not in names:
        raise KeyError(f"unknown decoder-layer tensor on disk: {disk_key}")
    return names[disk_key]


def layer_state_from_disk(
    disk: dict[str, torch.Tensor], template: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`layer_state_to_disk`; ``template`` is the target layer's state dict (names)."""
    packed = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    names = {layer_key_to_disk(k): k for k in template if k not in packed}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {"w1": {}, "w2": {}, "w3": {}}
    for key, value in disk.items():
        match = _EXPERTS_RE.match(key)
        if match:
            experts[match.group(3)][int(match.group(2))] = value
        else:
            out[_invert(key, names)] = value
    if experts["w1"]:
        n = len(experts["w1"])
        gate = torch.stack([experts["w1"][e] for e in range(n)])
        up = torch.stack([experts["w3"][e] for e in range(n)])
        out["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out["mlp.experts.down_proj"] = torch.stack([experts["w2"][e] for e in range(n)])
    return out


def mtp_state_to_disk(module: MTPModule) -> dict[str, torch.Tensor]:
    """All MTP tensors under their on-disk names (``mtp.0.*``)."""
    out: dict[str, torch.Tensor] = {}
    block_state = {k[len("block.") :]: v for k, v in module.state_dict().items() if k.startswith("block.")}
    for key, value in layer_state_to_disk(block_state).items():
        out[MTP_PREFIX + key] = value
    for key, value in module.state_dict().items():
        if key.startswith("block."):
            continue
        out[MTP_PREFIX + _MTP_OWN_TO_DISK.get(key, key)] = value
    return {k: v.detach().contiguous() for k, v in out.items()}


def mtp_state_from_disk(module: MTPModule, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Disk tensors (any keys; only ``mtp.0.*`` are used) -> a state dict for ``module.load_state_dict``."""
    own = {disk: mem for mem, disk in _MTP_OWN_TO_DISK.items()}
    template = module.state_dict()
    block_template = {k[len("block.") :]: v for k, v in template.items() if k.startswith("block.")}
    block_disk: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not key.startswith(MTP_PREFIX):
            continue
        name = key[len(MTP_PREFIX) :]
        mem = own.get(name, name)
        if mem in template and not mem.startswith("block."):
            out[mem] = value
        else:
            block_disk[name] = value
    for key, value in layer_state_from_disk(block_disk, block_template).items():
        out["block." + key] = value
    return out
