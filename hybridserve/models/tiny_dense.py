"""A tiny dense decoder in paged form: RoPE multi-head attention (full, or over a sliding window), a
SwiGLU MLP, RMS norms. The engine's second architecture: it proves the engine serves any ``PagedModel``,
and engine tests run it beside DeepSeek-V4.

Its one cache group, ``kv``, holds every layer's K and V rows (one per token): a history group, or a
window group with ``sliding_window``. A query at position p reads the rows of positions
(p - sliding_window, p] (full attention: [0, p]) through the block table. It has no draft layers, no
compiled steps and no FP8 KV cache; the engine refuses those at start-up (``ModelInfo``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from hybridserve.cache.spec import CacheGroupSpec, GroupKind, RowField
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch
from hybridserve.layers.gather import gather_rows, put_rows
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.rope import Rotary, apply_rope
from hybridserve.layers.rope_config import RopeConfig
from hybridserve.models.interface import CacheTensors, MetaShapes, ModelInfo, RowReads
from hybridserve.models.loader import CheckpointError, ModelShard, read_config

KV = "kv"
NAME = "tiny_dense"


@dataclass(frozen=True)
class TinyDenseConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    sliding_window: int | None = None  # None: full attention
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TinyDenseConfig:
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields = set(cls.__dataclass_fields__) - {"eos_token_ids"}
        return cls(**{k: v for k, v in raw.items() if k in fields}, eos_token_ids=eos_ids)


@dataclass
class TinyMeta:
    """A step's reads and writes: every query reads ``span`` rows ending at its own position."""

    write_slots: torch.Tensor  # [T]
    read_slots: torch.Tensor  # [T, span]
    visible: torch.Tensor  # [T, span]
    cos_sin: tuple[torch.Tensor, torch.Tensor]


def _linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight.requires_grad_(False)
    return layer


class Attention(nn.Module):
    def __init__(self, cfg: TinyDenseConfig, key: str) -> None:
        super().__init__()
        self.key, self.heads, self.head_dim = key, cfg.num_attention_heads, cfg.head_dim
        width = cfg.num_attention_heads * cfg.head_dim
        self.wq, self.wk, self.wv = (_linear(cfg.hidden_size, width) for _ in range(3))
        self.wo = _linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, meta: TinyMeta, cache: CacheTensors) -> torch.Tensor:
        t, h, d = x.shape[0], self.heads, self.head_dim
        q = apply_rope(self.wq(x).view(t, h, d), *meta.cos_sin)
        k = apply_rope(self.wk(x).view(t, h, d), *meta.cos_sin)
        keys, values = cache[(KV, self.key, "k")], cache[(KV, self.key, "v")]
        put_rows(keys, meta.write_slots, k.flatten(1))
        put_rows(values, meta.write_slots, self.wv(x))
        span = meta.read_slots.shape[1]
        k_read = gather_rows(keys, meta.read_slots).view(t, span, h, d)
        v_read = gather_rows(values, meta.read_slots).view(t, span, h, d)
        scores = torch.einsum("thd,tshd->ths", q.float(), k_read.float()) * d**-0.5
        scores = scores.masked_fill(~meta.visible[:, None, :], float("-inf"))
        out = torch.einsum("ths,tshd->thd", scores.softmax(dim=-1), v_read.float())
        return self.wo(out.to(x.dtype).flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyDenseConfig, key: str) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, key)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate, self.up = (
            _linear(cfg.hidden_size, cfg.intermediate_size),
            _linear(cfg.hidden_size, cfg.intermediate_size),
        )
        self.down = _linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, meta: TinyMeta, cache: CacheTensors) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), meta, cache)
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyDenseModel(nn.Module):
    """The whole model (a ``PagedModel``); ``forward`` returns the pre-head hidden states [T, D]."""

    def __init__(self, cfg: TinyDenseConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, f"layers.{i}") for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.info = ModelInfo(
            NAME,
            cfg.vocab_size,
            cfg.max_position_embeddings,
            cfg.hidden_size,
            cfg.eos_token_ids,
            (cfg.hidden_size,),
        )
        self._rotary: dict[str, Rotary] = {}

    def cache_specs(self, include_mtp: bool = False, kv_cache_dtype: str = "auto") -> list[CacheGroupSpec]:
        assert not include_mtp and kv_cache_dtype in self.info.kv_cache_dtypes, "refused by the engine"
        width = self.cfg.num_attention_heads * self.cfg.head_dim
        fields = (RowField("k", width, self.dtype), RowField("v", width, self.dtype))
        layers = tuple(f"layers.{i}" for i in range(self.cfg.num_hidden_layers))
        window = self.cfg.sliding_window
        if window is None:
            return [CacheGroupSpec(KV, GroupKind.HISTORY, 1, fields, layers)]
        return [CacheGroupSpec(KV, GroupKind.WINDOW, 1, fields, layers, window_tokens=window - 1)]

    def rotary(self) -> dict[str, Rotary]:
        device = self.lm_head.weight.device
        if not self._rotary or self._rotary["main"].inv_freq.device != device:
            self._rotary = {"main": Rotary(RopeConfig(self.cfg.rope_theta, self.cfg.head_dim), device)}
        return self._rotary

    def attention_meta(self, batch: ForwardBatch, shapes: MetaShapes | None = None) -> TinyMeta:
        assert shapes is None, f"{NAME} has no compiled steps"
        layout = batch.host_layout()
        span = self.cfg.sliding_window or max(layout.ends, default=1)
        back = torch.arange(span - 1, -1, -1, device=batch.positions.device)
        rows = batch.positions[:, None] - back  # the query's own position last
        req = batch.req_indices[:, None]
        return TinyMeta(
            write_slots=batch.slots(KV, 1, batch.positions, batch.req_indices),
            read_slots=batch.slots(KV, 1, rows, req),
            visible=rows >= 0,
            cos_sin=self.rotary()["main"].cos_sin(batch.positions, self.dtype),
        )

    def decode_meta(self, batch: ForwardBatch, rows: dict[str, torch.Tensor], max_position: int) -> TinyMeta:
        raise NotImplementedError(f"{NAME} has no compiled steps")

    def row_reads(self, layout: BatchLayout) -> dict[str, RowReads]:
        return {}  # no compressed branches

    def prepare_compiled_decode(self) -> int:
        return 0

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: CacheTensors, meta: TinyMeta | None = None) -> torch.Tensor:
        meta = meta or self.attention_meta(batch)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, meta, cache)
        return x

    @torch.no_grad()
    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(streams))

    def mtp_forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> torch.Tensor:
        raise NotImplementedError(f"{NAME} has no draft layers")

    def mtp_decode(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        max_position: int,
        depth: int = 0,
        kv: tuple[torch.Tensor, ForwardBatch] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError(f"{NAME} has no draft layers")

    def mtp_write_kv(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> None:
        raise NotImplementedError(f"{NAME} has no draft layers")

    def mtp_logits(self, mtp_streams: torch.Tensor, depth: int = 0) -> torch.Tensor:
        raise NotImplementedError(f"{NAME} has no draft layers")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], folder: str | Path) -> None:
        """Copy the checkpoint's tensors (the parameter names) in, or raise naming what does not fit."""
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            if name not in params or params[name].shape != tensor.shape:
                raise CheckpointError(f"{folder}: {name} {tuple(tensor.shape)} is not a {NAME} weight")
            params[name].copy_(tensor.to(params[name].dtype))
            seen.add(name)
        if missing := sorted(set(params) - seen):
            raise CheckpointError(
                f"{folder}: checkpoint lacks {len(missing)} tensors: {', '.join(missing[:8])}"
            )

    def cast_(self, dtype: torch.dtype) -> None:
        """Cast weights to ``dtype``, the norms' excepted (they stay float32)."""
        self.dtype = dtype
        for p in self.parameters():
            if not getattr(p, "keep_fp32", False):
                p.data = p.data.to(dtype)


def build_meta_model(
    folder: str | Path, dtype: torch.dtype, shard: ModelShard | None = None
) -> TinyDenseModel:
    if shard is not None:
        raise CheckpointError(
            f"{folder}: {NAME} has no routed experts to split across ranks; serve it without "
            "--enable-expert-parallel"
        )
    raw = read_config(folder)
    if raw.get("quantization_config"):
        raise CheckpointError(f"{folder}: {NAME} has no quantized weights; serve a full-precision checkpoint")
    with torch.device("meta"):
        model = TinyDenseModel(TinyDenseConfig.from_dict(raw))
    model.cast_(dtype)
    return model


def load_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_quantized: bool = True,
    native_fp8: bool = False,
    shard: ModelShard | None = None,
) -> TinyDenseModel:
    """The model of ``folder`` with its weights (``keep_quantized`` and ``native_fp8`` change nothing)."""
    model = build_meta_model(folder, dtype, shard)
    model.to_empty(device=device)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    model.load_weights((kv for f in files for kv in load_file(str(f)).items()), folder)
    return model.eval()
