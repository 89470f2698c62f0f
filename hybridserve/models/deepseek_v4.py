"""DeepSeek-V4 in paged form: window + CSA (with the Lightning Indexer) + HCA attention, mHC, MoE, MTP.

Module and parameter names follow the on-disk DeepSeek layout (``layers.L.attn.wq_a``, ...), so
loading is a rename of a few top-level tensors. Attention writes new rows only through slot
mappings and reads only through block tables (see ``models/attention_meta.py``). Reference semantics:
transformers 5.23 ``DeepseekV4ForCausalLM``, including its dtype rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from hybridserve.cache.spec import CacheGroupSpec, GroupKind, RowField
from hybridserve.layers.attention import sink_attention
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch
from hybridserve.layers.fp8_rows import fp8_widths, read_rows, write_rows
from hybridserve.layers.gather import Rows, gather_rows, put_rows
from hybridserve.layers.hyper_connection import HyperConnection, HyperHead, hyper_residual
from hybridserve.layers.moe import MoE, prepare_all_experts
from hybridserve.layers.norm import RMSNorm, keep_fp32, unweighted_rms_norm
from hybridserve.layers.quantized_linear import dense_weight
from hybridserve.layers.rope import Rotary, apply_rope
from hybridserve.layers.window_pool import pool_windows, pooled_rows
from hybridserve.models.attention_meta import (
    CSA_ROWS,
    CSA_STATE,
    HCA_ROWS,
    HCA_STATE,
    MTP_KV,
    WINDOW_KV,
    AttentionMeta,
    CompressedMeta,
    NewRows,
    QueryBlocks,
    build_meta,
    decode_meta,
    tie_shapes,
    visible_rows,
)
from hybridserve.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from hybridserve.models.interface import CacheTensors, MetaShapes, ModelInfo, RowReads

CosSin = tuple[torch.Tensor, torch.Tensor]
KV_CACHE_DTYPES = ("auto", "fp8")


def _linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def _fp32(*shape: int) -> nn.Parameter:
    return keep_fp32(nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False))


class Compressor(nn.Module):
    """Pools per-token (kv, gate) rows of a window into one row: softmax(gate + ape)-weighted sum.

    With ``overlap`` (CSA), projections are twice as wide: row w mixes the first half ("Ca") of
    window w-1's tokens with the second half ("Cb") of window w's tokens.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = _linear(hidden, width)
        self.wgate = _linear(hidden, width)
        self.ape = _fp32(rate, width)
        self.norm = RMSNorm(dim, eps)

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``kv``/``gate`` [Nw, span, width] gathered rows -> pooled rows [Nw, dim] (before rope)."""
        return pooled_rows(kv, gate, valid, self.ape, self.norm.weight, self.norm.eps)


class Indexer(nn.Module):
    """Lightning Indexer: scores compressed rows per query and keeps the top ``index_topk``."""

    def __init__(self, cfg: DeepseekV4Config, rate: int) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = _linear(cfg.q_lora_rank, self.heads * self.dim)
        self.weights_proj = _linear(cfg.hidden_size, self.heads)
        self.compressor = Compressor(cfg.hidden_size, self.dim, rate, overlap=True, eps=cfg.rms_norm_eps)

    def select(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        keys: torch.Tensor,
        meta: CompressedMeta,
        rope: tuple[torch.Tensor, torch.Tensor],
        blocks: QueryBlocks,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` [B, N, d] each query block's rows -> (row numbers [B * Q, k], selected and visible
        [B * Q, k]) per padded query."""
        q = blocks.pad(apply_rope(self.wq_b(q_res).view(-1, self.heads, self.dim), *rope).float())
        w = blocks.pad(self.weights_proj(x).float() * self.heads**-0.5)
        B, N = keys.shape[0], keys.shape[1]
        per_block = q.view(B, blocks.size * self.heads, self.dim)
        scores = torch.matmul(per_block, keys.float().transpose(1, 2))  # [B, Q * H, N]
        scores = scores.view(q.shape[0], self.heads, N).relu_() * self.dim**-0.5
        visible = meta.read_visible.view(q.shape[0], N)
        scores = (scores * w[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        # A stable sort breaks exact ties (common: ReLU zeros) by row number, so the choice does not
        # depend on chunking, batching or prefix reuse; invisible rows (-inf) sort last.
        k = min(self.topk, N)
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return picked, picked < meta.read_count


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, key: str, layer_type: str) -> None:
        super().__init__()
        d, h = cfg.head_dim, cfg.num_attention_heads
        self.cfg, self.key, self.layer_type = cfg, key, layer_type
        self.heads, self.head_dim = h, d
        self.rope_name = "main" if layer_type == SLIDING else "compress"
        self.wq_a = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, h * d)
        self.wkv = _linear(cfg.hidden_size, d)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = _linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = _fp32(h)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type == CSA:
            rate = cfg.compress_rates[CSA]
            self.compressor = Compressor(cfg.hidden_size, d, rate, overlap=True, eps=cfg.rms_norm_eps)
            self.indexer = Indexer(cfg, rate)
        elif layer_type == HCA:
            rate = cfg.compress_rates[HCA]
            self.compressor = Compressor(cfg.hidden_size, d, rate, overlap=False, eps=cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, meta: AttentionMeta, cache: CacheTensors, rotary: dict[str, Rotary]
    ) -> torch.Tensor:
        cos, sin = meta.rope[self.rope_name]
        q_res = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_res).view(-1, self.heads, self.head_dim), self.cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        self.write_kv(x, (cos, sin), meta.token_slots[WINDOW_KV], cache)
        self._pool_step(x, meta, cache)
        split = meta.split
        if split is None:
            out = self._attend(q, q_res, x, meta, cache)
        else:  # the decodes' and the main group's reads apart, each into its rows (filler: main's after)
            out = q.new_empty(q.shape)
            for rows, reads in ((split.decode_rows, split.decode), (split.main_rows, meta)):
                out.index_copy_(0, rows, self._attend(q[rows], q_res[rows], x[rows], reads, cache, rows))
        out = apply_rope(out, cos, -sin)
        return self.wo_b(self._grouped_out(out))

    def _attend(
        self,
        q: torch.Tensor,
        q_res: torch.Tensor,
        x: torch.Tensor,
        reads: AttentionMeta,
        cache: CacheTensors,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the queries ``reads`` describes (``rows``: their step rows; None: every row)."""
        keys = read_rows(cache, (WINDOW_KV, self.key, "kv"), reads.window_slots)
        visible, selected = reads.window_visible, None
        if self.indexer is not None:
            selected = self._selected_keys(x, q_res, reads, cache, rows)
        elif self.compressor is not None:
            assert reads.hca is not None
            hca = reads.hca
            keys = torch.cat([keys, read_rows(cache, (HCA_ROWS, self.key, "kv"), hca.read_slots)], dim=1)
            visible = torch.cat([visible, hca.read_visible], dim=-1)
        blocks, scale = reads.blocks, self.head_dim**-0.5
        return blocks.unpad(sink_attention(blocks.pad(q), keys, visible, self.attn_sink, scale, selected))

    def write_kv(self, x: torch.Tensor, rope: CosSin, slots: torch.Tensor, cache: CacheTensors) -> None:
        """The tokens' window KV rows (K = V, rope on the last dims) into ``slots``."""
        write_rows(cache, (WINDOW_KV, self.key, "kv"), slots, apply_rope(self.norm(self.wkv(x)), *rope))

    def _grouped_out(self, out: torch.Tensor) -> torch.Tensor:
        g = self.cfg.o_groups
        x = out.reshape(out.shape[0], g, -1).transpose(0, 1)  # [G, T, in]
        w = dense_weight(self.wo_a, x.dtype).view(g, -1, x.shape[-1]).transpose(1, 2)  # [G, in, o]
        return torch.bmm(x, w).transpose(0, 1).flatten(1)

    def _pool_step(self, x: torch.Tensor, meta: AttentionMeta, cache: CacheTensors) -> None:
        """Store the step's compressor inputs and pool every window it completes (CSA: the indexer's too)."""
        if self.indexer is not None:
            assert self.compressor is not None and meta.csa is not None
            cm, slots = meta.csa, meta.token_slots[CSA_STATE]
            self._pool(self.compressor, x, cm, slots, cache, CSA_STATE, CSA_ROWS, ("kv", "gate", "kv"))
            fields = ("idx_kv", "idx_gate", "idx")
            self._pool(self.indexer.compressor, x, cm, slots, cache, CSA_STATE, CSA_ROWS, fields)
        elif self.compressor is not None:
            assert meta.hca is not None
            fields = ("kv", "gate", "kv")
            slots = meta.token_slots[HCA_STATE]
            self._pool(self.compressor, x, meta.hca, slots, cache, HCA_STATE, HCA_ROWS, fields)

    def _selected_keys(
        self,
        x: torch.Tensor,
        q_res: torch.Tensor,
        reads: AttentionMeta,
        cache: CacheTensors,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each padded query's top-k CSA rows [B * Q, k, d] and their visibility [B * Q, k] (``rows``: the
        queries' step rows, for the rope; None: every row)."""
        assert self.indexer is not None and reads.csa is not None
        cm = reads.csa
        idx_keys = read_rows(cache, (CSA_ROWS, self.key, "idx"), cm.read_slots)
        cos, sin = reads.rope["compress"]
        if rows is not None:
            cos, sin = cos[rows], sin[rows]
        picked, ok = self.indexer.select(x, q_res, idx_keys, cm, (cos, sin), reads.blocks)
        B, N = cm.read_slots.shape
        per_query = cm.read_slots[:, None, :].expand(B, reads.blocks.size, N)
        picked_rows = per_query.gather(2, picked.view(B, reads.blocks.size, picked.shape[1]))  # indices < N
        return read_rows(cache, (CSA_ROWS, self.key, "kv"), picked_rows.flatten(0, 1)), ok

    def _pool(
        self,
        comp: Compressor,
        x: torch.Tensor,
        cm: CompressedMeta,
        slots: torch.Tensor,
        cache: CacheTensors,
        state: str,
        rows: str,
        fields: tuple[str, str, str],
    ) -> None:
        """Store this step's compressor inputs, then pool every window the step completes."""
        kv_rows, gate_rows = cache[(state, self.key, fields[0])], cache[(state, self.key, fields[1])]
        put_rows(kv_rows, slots, comp.wkv(x))
        put_rows(gate_rows, slots, comp.wgate(x))
        new = cm.new_rows
        if new is None:
            return
        write_rows(cache, (rows, self.key, fields[2]), new.slots, _pooled(comp, kv_rows, gate_rows, new))


def _pooled(comp: Compressor, kv_rows: Rows, gate_rows: Rows, new: NewRows) -> torch.Tensor:
    """The roped rows of the windows ``new`` completes. A compiled CPU decode step pools an HCA window only
    when some request completes one (``window_pool``); a CSA window completes every few tokens."""
    completes = new.completes
    if completes is not None and torch.compiler.is_compiling() and new.slots.device.type == "cpu":
        kv, gate = _strided(kv_rows), _strided(gate_rows)
        src, valid, (cos, sin), norm = new.src_slots, new.src_valid, new.rope, comp.norm
        return pool_windows(kv, gate, src, valid, completes, comp.ape, norm.weight, norm.eps, cos, sin)
    src = new.src_slots
    pooled = comp.compress(gather_rows(kv_rows, src), gather_rows(gate_rows, src), new.src_valid)
    return apply_rope(pooled, *new.rope)


def _strided(rows: Rows) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else rows.strided()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, key: str, layer_type: str, mlp_type: str) -> None:
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn = Attention(cfg, key, layer_type)
        self.ffn = MoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.vocab_size,
            mlp_type == "hash_moe",
            cfg.scoring_func,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
        )
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        meta: AttentionMeta,
        cache: CacheTensors,
        rotary: dict[str, Rotary],
    ) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = hyper_residual(self.attn(self.attn_norm(x), meta, cache, rotary), streams, post, comb)
        post, comb, x = self.hc_ffn(streams)
        return hyper_residual(self.ffn(self.ffn_norm(x), input_ids), streams, post, comb)

    def write_kv(self, streams: torch.Tensor, rope: CosSin, slots: torch.Tensor, cache: CacheTensors) -> None:
        """Only the window KV rows ``forward`` would write (a window layer's; no attention, no FFN)."""
        self.attn.write_kv(self.attn_norm(self.hc_attn.collapse(streams)), rope, slots, cache)


class MTPLayer(nn.Module):
    """Multi-token prediction: streams at t and the embedding of t+1 -> logits for t+2."""

    def __init__(self, cfg: DeepseekV4Config, key: str) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.e_proj, self.h_proj = _linear(d, d), _linear(d, d)
        self.enorm, self.hnorm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.block = DecoderLayer(cfg, key, SLIDING, "moe")
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, d, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(
        self,
        prev_streams: torch.Tensor,
        next_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        meta: AttentionMeta,
        cache: CacheTensors,
        rotary: dict[str, Rotary],
    ) -> torch.Tensor:
        return self.block(self.input(prev_streams, next_embeds), input_ids, meta, cache, rotary)

    def input(self, prev_streams: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        return self.h_proj(self.hnorm(prev_streams)) + self.e_proj(self.enorm(next_embeds)).unsqueeze(-2)


class DeepseekV4Model(nn.Module):
    """The whole model (a ``PagedModel``); ``forward`` returns the pre-head residual streams [T, hc, D]."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        # An uninitialised table (the checkpoint fills it): nn.Embedding's random init would import
        # torch._dynamo (~1.5 s) on the meta device, which an eager engine never needs.
        rows = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=rows, _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, f"layers.{i}", t, cfg.mlp_layer_types[i]) for i, t in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTPLayer(cfg, f"mtp.{i}") for i in range(cfg.num_nextn_predict_layers))
        self._rotary: dict[str, Rotary] = {}
        self.info = model_info(cfg)
        # (branch, tokens per row, indexer top-k) of each compressed branch some layer reads
        self._branches = tuple(
            (name, cfg.compress_rates[kind], topk)
            for name, kind, topk in (("csa", CSA, cfg.index_topk), ("hca", HCA, 0))
            if kind in cfg.layer_types
        )

    def cache_specs(self, include_mtp: bool = False, kv_cache_dtype: str = "auto") -> list[CacheGroupSpec]:
        return cache_specs(self.cfg, self.dtype, include_mtp, kv_cache_dtype)

    def rotary(self) -> dict[str, Rotary]:
        device = self.head.weight.device
        if not self._rotary or self._rotary["main"].inv_freq.device != device:
            self._rotary = {name: Rotary(r, device) for name, r in self.cfg.rope.items()}
        return self._rotary

    def compress_rates(self) -> dict[str, int]:
        return {"csa": self.cfg.compress_rates.get(CSA, 0), "hca": self.cfg.compress_rates.get(HCA, 0)}

    def row_reads(self, layout: BatchLayout) -> dict[str, RowReads]:
        """Per compressed branch: the rows a step of ``layout`` sees, its rate and the CSA indexer's top-k."""
        # One pass over the layout for every branch: visible_rows(layout, m) == visible_rows(layout, 1) // m.
        seen = visible_rows(layout, 1)
        return {name: RowReads(seen // m, m, k) for name, m, k in self._branches}

    def attention_meta(self, batch: ForwardBatch, shapes: MetaShapes | None = None) -> AttentionMeta:
        """The step's metadata from its host layout; ``shapes``: the uniform form of a compiled step."""
        rates, rotary = self.compress_rates(), self.rotary()
        return build_meta(batch, self.cfg.sliding_window, rates, rotary, self.dtype, shapes)

    def decode_meta(
        self, batch: ForwardBatch, rows: dict[str, torch.Tensor], max_position: int
    ) -> AttentionMeta:
        """A padded pure-decode batch's metadata from its device tensors (``attention_meta.decode_meta``)."""
        rates, rotary = self.compress_rates(), self.rotary()
        return decode_meta(batch, rows, max_position, self.cfg.sliding_window, rates, rotary, self.dtype)

    def prepare_compiled_decode(self) -> int:
        """Ready the weights a compiled CPU decode step reads: flat copies of small routed experts, run all
        at once for few tokens (``Experts.prepare_all_experts``) -> how many MoEs take that form."""
        return prepare_all_experts(self)

    @torch.no_grad()  # not inference_mode: compiled decode steps take normal tensors
    def forward(
        self, batch: ForwardBatch, cache: CacheTensors, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        meta = meta or self.attention_meta(batch)
        if torch.compiler.is_compiling():
            tie_shapes(meta, batch.input_ids.shape[0])
        rotary = self.rotary()
        x = self.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch.input_ids, meta, cache, rotary)
        return streams

    @torch.no_grad()
    def compute_logits(
        self, streams: torch.Tensor, hc_head: HyperHead | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        h = (norm or self.norm)((hc_head or self.hc_head)(streams))
        return self.head(h)

    @torch.inference_mode()
    def mtp_forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> torch.Tensor:
        """MTP layer ``depth`` at positions t: ``streams`` are the trunk's at t (or this layer's own output
        at t, drafting further), ``batch.input_ids`` the tokens t+1. Its window KV (row t) lives in the
        draft group ``mtp_kv``; the batch's tables need only that group. -> MTP streams."""
        layer = self._mtp_layer(depth)
        # The MTP block is a plain sliding-window layer: it reads its own group as the window group.
        tables = {WINDOW_KV: batch.block_tables[MTP_KV]}
        view = dataclasses.replace(batch, block_tables=tables)
        embeds = self.embed_tokens(batch.input_ids)
        own = _mtp_cache(layer, cache)
        return layer(streams, embeds, batch.input_ids, self.attention_meta(view), own, self.rotary())

    @torch.no_grad()  # not inference_mode: compiled draft steps take normal tensors
    def mtp_decode(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        max_position: int,
        depth: int = 0,
        kv: tuple[torch.Tensor, ForwardBatch] | None = None,
    ) -> torch.Tensor:
        """``mtp_forward`` of a padded batch of one-token rows, its metadata built from the batch's device
        tensors (``decode_meta``), so that it runs inside a compiled draft step. ``kv``: (streams, batch)
        of more rows that first write only their window row (``mtp_write_kv``), in the same step."""
        layer = self._mtp_layer(depth)
        if kv is not None:
            self._write_mtp_kv(layer, *kv, cache, max_position)
        tables = {WINDOW_KV: batch.block_tables[MTP_KV]}  # dynamo traces no dataclasses.replace
        view = ForwardBatch(
            batch.input_ids,
            batch.positions,
            batch.req_indices,
            batch.seq_ends,
            tables,
            batch.block_tokens,
            batch.logits_indices,
        )
        meta = self.decode_meta(view, {}, max_position)
        embeds = self.embed_tokens(batch.input_ids)
        return layer(streams, embeds, batch.input_ids, meta, _mtp_cache(layer, cache), self.rotary())

    @torch.inference_mode()
    def mtp_write_kv(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> None:
        """Only the window KV rows ``mtp_forward`` would write at the batch's positions (no attention, MoE,
        head): what positions no draft starts from owe the window of later drafts. Eager; inside a draft
        step they are ``mtp_decode``'s ``kv`` rows."""
        top = max(batch.host_layout().ends, default=1) - 1
        self._write_mtp_kv(self._mtp_layer(depth), streams, batch, cache, top)

    def _write_mtp_kv(
        self, layer: MTPLayer, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, top: int
    ) -> None:
        """``mtp_write_kv``'s rows, positions at most ``top``."""
        slots = batch.slots(MTP_KV, 1, batch.positions, batch.req_indices)
        rope = self.rotary()[layer.block.attn.rope_name].cos_sin(batch.positions, self.dtype, top)
        x = layer.input(streams, self.embed_tokens(batch.input_ids))
        layer.block.write_kv(x, rope, slots, _mtp_cache(layer, cache))

    def _mtp_layer(self, depth: int) -> MTPLayer:
        layer = self.mtp[depth]
        assert isinstance(layer, MTPLayer)
        return layer

    def mtp_logits(self, mtp_streams: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits for t+2 from the MTP layer's streams: its own hc_head and norm, the shared head."""
        layer = self._mtp_layer(depth)
        return self.compute_logits(mtp_streams, layer.hc_head, layer.norm)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], unknown: list[str]) -> set[str]:
        """Copy checkpoint tensors (on-disk names) into the model; returns the keys it filled.

        Names the model has no place for are appended to ``unknown``; MTP tensors beyond the
        configured MTP layers are skipped.
        """
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        filled: set[str] = set()
        for disk_name, tensor in weights:
            name, expert, which = checkpoint_to_param(disk_name)
            if name not in params:
                if not name.startswith("mtp."):
                    unknown.append(disk_name)
                continue
            target = params[name]
            if expert is not None:
                target = target[expert]
                if which is not None:
                    half = target.shape[0] // 2
                    target = target[:half] if which == "w1" else target[half:]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{disk_name}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))
            filled.add(_fill_key(name, expert, which))
        return filled

    def expected_weights(self) -> set[str]:
        """Every key ``load_weights`` must fill for the model to be complete."""
        keys: set[str] = set()
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            # Experts held here: all, or one rank's range (distributed.ExpertShard).
            if name.endswith(("experts.gate_up", "experts.gate_up_scale")):
                keys.update(_fill_key(name, e, w) for e in range(p.shape[0]) for w in ("w1", "w3"))
            elif name.endswith(("experts.down", "experts.down_scale")):
                keys.update(_fill_key(name, e, None) for e in range(p.shape[0]))
            else:
                keys.add(name)
        return keys

    def cast_(self, dtype: torch.dtype) -> None:
        """Cast weights to ``dtype`` except those the reference keeps in float32 (norms, hc, sinks...)."""
        self.dtype = dtype
        for p in self.parameters():
            if not getattr(p, "keep_fp32", False) and not getattr(p, "quantized", False):
                p.data = p.data.to(dtype)


def model_info(cfg: DeepseekV4Config) -> ModelInfo:
    return ModelInfo(
        name="deepseek_v4",
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_size=cfg.hidden_size,
        eos_token_ids=cfg.eos_token_ids,
        stream_shape=(cfg.hc_mult, cfg.hidden_size),
        num_draft_layers=cfg.num_nextn_predict_layers,
        draft_group=MTP_KV,
        compiled_steps=True,
        kv_cache_dtypes=KV_CACHE_DTYPES,
        expert_parallel=True,
    )


def _fill_key(name: str, expert: int | None, which: str | None) -> str:
    return name if expert is None else f"{name}.{expert}" + (f".{which}" if which else "")


_TOP_LEVEL = {
    "embed.weight": "embed_tokens.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "lm_head.weight": "head.weight",
}


def _mtp_cache(layer: MTPLayer, cache: CacheTensors) -> CacheTensors:
    """The MTP layer's rows of the draft group, under the window group's name (every field: FP8 rows
    have several)."""
    key = layer.block.attn.key
    return {(WINDOW_KV, k[1], k[2]): t for k, t in cache.items() if k[0] == MTP_KV and k[1] == key}


_MTP_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head")


def checkpoint_to_param(disk_name: str) -> tuple[str, int | None, str | None]:
    """Map a tensor name of the transformers or the official layout to (parameter, expert, w1/w3)."""
    name = disk_name.removeprefix("model.")
    name = _TOP_LEVEL.get(name, name)
    for part in ("hc_attn", "hc_ffn"):
        for suffix in ("fn", "base", "scale"):
            name = name.replace(f"{part}_{suffix}", f"{part}.{suffix}")
    if name.startswith("mtp."):
        name = _mtp_name(name)
    if ".ffn.experts." in name:
        prefix, rest = name.split(".ffn.experts.")
        expert, which, kind = ([*rest.split("."), ""])[:3]
        suffix = "_scale" if kind == "scale" else ""  # a quantized expert's scale grid
        if which == "w2":
            return f"{prefix}.ffn.experts.down{suffix}", int(expert), None
        return f"{prefix}.ffn.experts.gate_up{suffix}", int(expert), which
    return name, None, None


def _mtp_name(name: str) -> str:
    """``mtp.0.X``: the layer's own tensors stay, the decoder block's move under ``block.``."""
    _, idx, rest = name.split(".", 2)
    if rest.startswith("hc_head_"):
        return f"mtp.{idx}.hc_head.hc_{rest.removeprefix('hc_head_')}"
    if rest.startswith(_MTP_OWN):
        return f"mtp.{idx}.{rest}"
    return f"mtp.{idx}.block.{rest}"


def cache_specs(
    cfg: DeepseekV4Config, dtype: torch.dtype, include_mtp: bool = False, kv_cache_dtype: str = "auto"
) -> list[CacheGroupSpec]:
    """Every kind of per-request state the model keeps, as cache groups. With ``kv_cache_dtype`` "fp8",
    the window KV, compressed rows and indexer keys are stored FP8 (see ``fp8_rows``); the compressor
    inputs stay in ``dtype``, as DeepSeek keeps its compressor state in full precision."""
    d, i = cfg.head_dim, cfg.index_head_dim
    kv = _kv_fields(cfg, dtype, kv_cache_dtype)
    layers = [f"layers.{n}" for n in range(cfg.num_hidden_layers)]
    csa = [k for k, t in zip(layers, cfg.layer_types, strict=True) if t == CSA]
    hca = [k for k, t in zip(layers, cfg.layer_types, strict=True) if t == HCA]
    specs = [
        CacheGroupSpec(
            WINDOW_KV,
            GroupKind.WINDOW,
            1,
            kv("kv", d),
            tuple(layers),
            window_tokens=cfg.sliding_window - 1,
        )
    ]
    if include_mtp and cfg.num_nextn_predict_layers:
        mtp = tuple(f"mtp.{n}" for n in range(cfg.num_nextn_predict_layers))
        window = cfg.sliding_window - 1
        specs.append(
            CacheGroupSpec(MTP_KV, GroupKind.WINDOW, 1, kv("kv", d), mtp, window_tokens=window, draft=True)
        )
    if csa:
        m = cfg.compress_rates[CSA]
        state = tuple(
            RowField(n, w, dtype)
            for n, w in (("kv", 2 * d), ("gate", 2 * d), ("idx_kv", 2 * i), ("idx_gate", 2 * i))
        )
        specs.append(
            CacheGroupSpec(CSA_STATE, GroupKind.WINDOW, 1, state, tuple(csa), window_tokens=2 * m - 1)
        )
        rows = kv("kv", d) + kv("idx", i)
        specs.append(CacheGroupSpec(CSA_ROWS, GroupKind.HISTORY, m, rows, tuple(csa)))
    if hca:
        m = cfg.compress_rates[HCA]
        state = (RowField("kv", d, dtype), RowField("gate", d, dtype))
        specs.append(CacheGroupSpec(HCA_STATE, GroupKind.WINDOW, 1, state, tuple(hca), window_tokens=m - 1))
        specs.append(CacheGroupSpec(HCA_ROWS, GroupKind.HISTORY, m, kv("kv", d), tuple(hca)))
    return specs


def _kv_fields(
    cfg: DeepseekV4Config, dtype: torch.dtype, kv_cache_dtype: str
) -> Callable[[str, int], tuple[RowField, ...]]:
    """(name, width) -> the fields of a KV-like row: one in ``dtype``, or FP8's three parts."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    rope = cfg.rope_head_dim
    if kv_cache_dtype == "fp8" and any(r.rope_dim != rope for r in cfg.rope.values()):
        raise ValueError("an FP8 KV cache needs one rope width for every attention kind")

    def fields(name: str, width: int) -> tuple[RowField, ...]:
        if kv_cache_dtype != "fp8" or width <= rope:
            return (RowField(name, width, dtype),)
        return tuple(RowField(name + sfx, w, dt or dtype) for sfx, w, dt in fp8_widths(width, rope))

    return fields


__all__ = ["DeepseekV4Model", "cache_specs", "checkpoint_to_param"]
