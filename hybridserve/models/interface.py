"""The model interface: what the engine needs of a model, whatever its architecture.

The registry (``models/registry.py``) loads a checkpoint into a model behind :class:`PagedModel`; the
engine reads its facts from :class:`ModelInfo`, sizes its cache from ``cache_specs``, runs ``forward``
over a ForwardBatch and never names an architecture, a cache group or a metadata type. A model's
attention metadata (``M``) is opaque to the engine: it only hands what ``attention_meta`` or
``decode_meta`` built back to ``forward``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from hybridserve.cache.spec import CacheGroupSpec
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch
from hybridserve.layers.gather import Rows
from hybridserve.layers.rope import Rotary

M = TypeVar("M")  # a model's attention metadata
CacheTensors = Mapping[tuple[str, str, str], Rows]  # (group, layer, field) -> the pool's rows


@dataclass(frozen=True)
class ModelInfo:
    """The config facts the engine reads, and which of its features the model supports."""

    name: str  # the checkpoint's model_type, for errors
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    stream_shape: tuple[int, ...]  # one token's pre-head state, as ``forward`` returns it
    num_draft_layers: int = 0  # MTP layers whose weights were loaded
    draft_group: str | None = None  # the cache group of the draft layers' window KV
    compiled_steps: bool = False  # decode graphs and the compiled prefill graph
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    expert_parallel: bool = False  # routed experts a ModelShard can split across ranks


class RowReads(NamedTuple):
    """One compressed branch of a step: the rows its queries see, and what bounds its padded count (a
    tuple: the decode graphs ask for it every step)."""

    visible: int  # the most rows any query of the step sees
    tokens_per_row: int  # a full context reads ``max_model_len // tokens_per_row`` rows
    indexed: int = 0  # the top-k an indexer keeps of them (0: every row is read)


@dataclass(frozen=True)
class MetaShapes:
    """Metadata shaped for a graph compiled with dynamic sizes (``engine/worker/prefill_graphs.py``), so
    that one graph serves every step: no shortcut that changes the structure and no dim whose size could
    be 0 or 1, which dynamo would specialise.

    Query blocks are picked among ``block_sizes`` (all >= 2), and each compressed branch reads
    ``rows[branch]`` rows (padded past what any query sees; the padding is never visible).
    """

    block_sizes: tuple[int, ...]
    rows: dict[str, int]


class PagedModel(Protocol[M]):
    """A decoder in paged form: it writes new rows through slot mappings and reads through block tables."""

    info: ModelInfo
    dtype: torch.dtype
    layers: nn.ModuleList  # the trunk's decoder layers, in forward order

    def __call__(self, batch: ForwardBatch, cache: CacheTensors, meta: M | None = None) -> torch.Tensor:
        """The step's pre-head streams [T, *stream_shape] (``meta``: prebuilt, else built eagerly)."""
        ...

    def cache_specs(self, include_mtp: bool = False, kv_cache_dtype: str = "auto") -> list[CacheGroupSpec]:
        """Every kind of per-request state the model keeps, one cache group each."""
        ...

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor: ...

    def modules(self) -> Iterator[nn.Module]: ...

    # ---- compiled-step hooks ------------------------------------------------------------------------
    def attention_meta(self, batch: ForwardBatch, shapes: MetaShapes | None = None) -> M:
        """The step's metadata from its host layout; ``shapes``: the uniform form of a compiled step."""
        ...

    def decode_meta(self, batch: ForwardBatch, rows: dict[str, torch.Tensor], max_position: int) -> M:
        """A padded pure-decode batch's metadata from device tensors alone (``rows[branch]``: arange of the
        branch's row reads), so that it runs inside a compiled step."""
        ...

    def row_reads(self, layout: BatchLayout) -> dict[str, RowReads]:
        """Per compressed branch the model reads: what a step of ``layout`` reads (empty: none)."""
        ...

    def rotary(self) -> dict[str, Rotary]:
        """The rotary tables by name (a compiled step reserves their positions up front)."""
        ...

    def prepare_compiled_decode(self) -> int:
        """Ready the weights a compiled decode step reads -> how many modules changed form."""
        ...

    # ---- the draft (MTP) layers ---------------------------------------------------------------------
    def mtp_forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> torch.Tensor:
        """Draft layer ``depth`` at positions t from streams at t and tokens t+1 -> its streams."""
        ...

    def mtp_decode(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        max_position: int,
        depth: int = 0,
        kv: tuple[torch.Tensor, ForwardBatch] | None = None,
    ) -> torch.Tensor:
        """``mtp_forward`` of a padded batch of one-token rows from device tensors alone (as
        ``decode_meta``), so that it runs inside a compiled draft step; ``kv``: (streams, batch) of more
        rows that first write only their window row (``mtp_write_kv``) in the same step."""
        ...

    def mtp_write_kv(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, depth: int = 0
    ) -> None:
        """Only the window rows ``mtp_forward`` would write at the batch's positions."""
        ...

    def mtp_logits(self, mtp_streams: torch.Tensor, depth: int = 0) -> torch.Tensor: ...
