"""Static-shaped decode steps, bucketed by batch size, replayed as CUDA graphs (vLLM's scheme).

A pure-decode step (every request computes one token) of R requests is padded to the next bucket B in
(1, 2, 4, ..., max_num_seqs) with dummy requests: position 0, every block-table entry the null block,
token id 0. The attention metadata is built eagerly, outside the graph, from that padded batch with
``pad_windows`` (one compressed-window entry per request and branch), and each branch's row reads are
null-padded to a bucketed row count N (powers of two, at most ``max_model_len // m``). The metadata
tensors and the token ids are then copied into persistent buffers of the shape key (B, N per branch),
and the forward, the logits of all B rows and the re-zeroing of the null blocks run on those buffers:
as one captured ``torch.cuda.CUDAGraph`` per key on CUDA, eagerly elsewhere.

Dummy rows write their own token's inputs into row 0 of the null block of every per-token group (and
the window-padding entries then pool them into the null row of the compressed groups). Nothing reads
the null block unmasked (invisible keys get zero weight, and the values are finite), so real rows are
unaffected; the null blocks are zeroed again at the end of every padded step, which keeps the padded
window design's invariant (the null block is all zeros) between steps.

With ``compiled`` the forward and logits of the static step run through ``torch.compile`` (inductor: C++
loops on CPU, Triton on CUDA), which fuses the ~2,000 small ops of a decode step into a few dozen
kernels. The batch dimension (B > 1) is marked dynamic, so one graph serves batch 1 and one every other
bucket; the compressed-row counts stay static (a graph per row bucket: marking them dynamic too made one
compile take minutes). On CPU the routed experts run inside the graph as the opaque
``hybridserve::grouped_experts`` op (``layers/moe.py``), the eager grouped path's own ops. The cache
writes are ``index_put_`` (which inductor keeps in place; an ``index_copy_`` into a graph input becomes a
copy of the whole pool tensor), and the null-block zeroing runs eagerly after the graph for the same reason.
Compiling happens on the first step of each graph (or in :meth:`DecodeGraphRunner.warmup`); its time is
logged and kept in ``compile_seconds``, and inductor caches the generated code on disk
(``TORCHINDUCTOR_CACHE_DIR``), so a restart with the same model compiles much faster.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import NULL_BLOCK, BlockPoolSet
from hybridserve.engine.scheduler import ScheduledRequest
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.models.attention_meta import AttentionMeta, CompressedMeta, visible_rows
from hybridserve.models.deepseek_v4 import DeepseekV4Model

log = logging.getLogger(__name__)

MIN_ROW_BUCKET = 16
BATCH_STEP = 8


def batch_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 below ``max_num_seqs``, then itself."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += range(BATCH_STEP, max_num_seqs, BATCH_STEP)
    return [*sizes, max_num_seqs]


def row_bucket(n: int, most: int, least: int = MIN_ROW_BUCKET) -> int:
    """The padded compressed-row count for ``n`` rows: a power of two >= ``least``, capped at ``most``."""
    return min(max(least, 1 << max(n - 1, 0).bit_length()), max(most, n))


def is_pure_decode(scheduled: list[ScheduledRequest]) -> bool:
    return bool(scheduled) and all(s.num_tokens == 1 for s in scheduled)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a metadata tree (dataclasses, dicts, tuples), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, tuple | list):
        return [t for v in obj for t in tensors_of(v)]
    return []


def clone_tree(obj: Any) -> Any:
    """The same tree with every tensor cloned, contiguous (persistent buffers of the same shapes; their
    strides follow from the shapes alone, so a compiled graph's stride guards hold for every key)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone(memory_format=torch.contiguous_format)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: clone_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def _reads(branch: CompressedMeta | None) -> int:
    return 0 if branch is None else branch.read_slots.shape[1]


def pad_reads(branch: CompressedMeta | None, n: int) -> CompressedMeta | None:
    """``branch`` reading ``n`` rows: the extra ones are the null block's slot 0, never visible."""
    if branch is None:
        return None
    extra = n - branch.read_slots.shape[1]
    assert extra >= 0
    return dataclasses.replace(
        branch,
        read_slots=F.pad(branch.read_slots, (0, extra), value=0),
        read_visible=F.pad(branch.read_visible, (0, extra), value=False),
    )


@dataclass
class StaticDecode:
    """The persistent buffers (and, on CUDA, the graph) of one shape key."""

    batch: ForwardBatch  # only input_ids is read by the model when the metadata is given
    meta: AttentionMeta
    logits: torch.Tensor | None = None  # [B, V], written by every run
    graph: torch.cuda.CUDAGraph | None = None
    ran: bool = False  # the first run of a key may compile

    def mark_dynamic(self) -> None:
        """The batch dim (B > 1) and the compressed-row dim as dynamic: one compiled graph for batch 1 and
        one for every other bucket, whatever the context, so serving never stops to compile."""
        b = self.batch.input_ids.shape[0]
        for t in tensors_of(self):
            if b > 1 and t.dim() > 0 and t.shape[0] == b:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for branch in (self.meta.csa, self.meta.hca):
            if branch is not None:
                torch._dynamo.maybe_mark_dynamic(branch.read_slots, 1)
                torch._dynamo.maybe_mark_dynamic(branch.read_visible, 1)


class DecodeGraphRunner:
    """Runs pure-decode steps padded to static shapes; ``use_graphs`` captures and replays on CUDA."""

    def __init__(
        self,
        model: DeepseekV4Model,
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        batch_sizes: list[int] | None = None,
        pad_rows: bool = True,
        compiled: bool = False,
    ) -> None:
        """``batch_sizes``: the buckets (default ``batch_buckets``); ``pad_rows``: bucket N (else exact);
        ``compiled``: the static step through ``torch.compile`` (see the module docstring)."""
        self.model, self.coordinator, self.device = model, coordinator, device
        self.cache = pools.tensors()
        self.buckets = sorted(batch_sizes or batch_buckets(max_num_seqs))
        self.pad_rows = pad_rows
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs and device.type == "cuda"
        self.null_rows = [
            t[NULL_BLOCK * p.plan.rows_per_block : (NULL_BLOCK + 1) * p.plan.rows_per_block]
            for p in pools.pools.values()
            for t in p.tensors.values()
        ]
        self.entries: dict[tuple[int, int, int], StaticDecode] = {}
        self.graph_pool: Any = None
        self.compiled: Callable[[StaticDecode], torch.Tensor] | None = None
        if compiled:
            self.compiled = torch.compile(self._logits, dynamic=None)
        self.compile_seconds = 0.0  # wall time of the first runs of new keys (compiles included)

    def supports(self, scheduled: list[ScheduledRequest]) -> bool:
        return is_pure_decode(scheduled) and len(scheduled) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def warmup(self) -> float:
        """Run dummy-only steps of batch 1 and 2 (the two graphs), so serving starts compiled; seconds."""
        start = time.perf_counter()
        for size in self.buckets[:2]:
            self.run([], size)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest], size: int = 0) -> torch.Tensor:
        """Logits [R, V] of every scheduled request (all of a pure-decode step's rows), in order; the
        batch padded to the bucket of ``max(len(scheduled), size)``."""
        batch = self.padded_batch(scheduled, size)
        meta = self.model.attention_meta(batch)
        layout = batch.host_layout()
        rows = {name: self._rows(getattr(meta, name), layout, name == "csa") for name in ("csa", "hca")}
        meta = dataclasses.replace(
            meta, csa=pad_reads(meta.csa, rows["csa"]), hca=pad_reads(meta.hca, rows["hca"])
        )
        # Compiled graphs take no inference tensors: the persistent buffers are normal ones.
        with torch.inference_mode(False), torch.no_grad():
            entry = self._entry((batch.num_tokens, rows["csa"], rows["hca"]), batch, meta)
            entry.batch.input_ids.copy_(batch.input_ids)
            for dst, src in zip(tensors_of(entry.meta), tensors_of(meta), strict=True):
                dst.copy_(src)
            if self.use_graphs:
                self._replay(entry)
            else:
                entry.logits = self._forward(entry)
        assert entry.logits is not None
        return entry.logits[: len(scheduled)]

    def _rows(self, branch: CompressedMeta | None, layout: BatchLayout, indexed: bool = False) -> int:
        if branch is None:
            return 0
        if not self.pad_rows:
            return visible_rows(layout, branch.rate)
        most = self.max_model_len // branch.rate
        least = self._least_indexed_rows() if indexed and self.compiled is not None else MIN_ROW_BUCKET
        return row_bucket(visible_rows(layout, branch.rate), most, least)

    def _least_indexed_rows(self) -> int:
        """Compiled CSA reads more than ``index_topk`` rows (padded rows are never visible): the indexer
        then keeps ``topk`` of them at every context, and one graph serves all (traced at ``topk`` rows
        or fewer, the graph would be specialised to keeping every row)."""
        return max(MIN_ROW_BUCKET, 1 << self.model.cfg.index_topk.bit_length())

    def padded_batch(self, scheduled: list[ScheduledRequest], size: int = 0) -> ForwardBatch:
        """The step's requests, then dummies (position 0, null tables) up to the bucket size."""
        r, b = len(scheduled), self.bucket(max(len(scheduled), size))
        starts = [s.start for s in scheduled] + [0] * (b - r)
        ids = [s.request.all_token_ids[s.start] for s in scheduled] + [0] * (b - r)
        rows = list(range(b))
        host = host_tensor(ids + starts + rows + [p + 1 for p in starts])
        input_ids, pos, req, ends = host.to(self.device).view(4, b).unbind(0)
        return ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            req_indices=req,
            seq_ends=ends,
            block_tables=self._tables(scheduled, b),
            block_tokens=self.coordinator.block_tokens,
            logits_indices=req,
            layout=BatchLayout(tuple(starts), tuple(p + 1 for p in starts), pad_windows=True),
        )

    def _tables(self, scheduled: list[ScheduledRequest], b: int) -> dict[str, torch.Tensor]:
        """Every group's [B, width] table, dummy rows all null; one transfer."""
        tables = [self.coordinator.block_tables(s.request.request_id) for s in scheduled]
        names = [g.spec.name for g in self.coordinator.plan.groups]
        width = max([1, *(len(t[name]) for t in tables for name in names)])
        flat: list[int] = []
        for name in names:
            for t in tables:
                flat += t[name] + [NULL_BLOCK] * (width - len(t[name]))
            flat += [NULL_BLOCK] * (width * (b - len(tables)))
        packed = host_tensor(flat).to(self.device).view(len(names), b, width)
        return dict(zip(names, packed.unbind(0), strict=True))

    def _entry(self, key: tuple[int, int, int], batch: ForwardBatch, meta: AttentionMeta) -> StaticDecode:
        if key not in self.entries:
            static = dataclasses.replace(batch, input_ids=batch.input_ids.clone(), block_tables={})
            self.entries[key] = StaticDecode(static, clone_tree(meta))
            if self.compiled is not None:
                self.entries[key].mark_dynamic()
        return self.entries[key]

    def _forward(self, entry: StaticDecode) -> torch.Tensor:
        """The static step: forward and logits of all B rows, then the null blocks zeroed again."""
        logits = (self.compiled or self._logits)(entry) if entry.ran else self._first_run(entry)
        torch._foreach_zero_(self.null_rows)
        return logits

    def _first_run(self, entry: StaticDecode) -> torch.Tensor:
        """The key's first run, timed (it compiles a graph if none fits); eager if compiling fails."""
        start = time.perf_counter()
        try:
            logits = (self.compiled or self._logits)(entry)
        except Exception:  # a missing C++ compiler, an unsupported op: serve eagerly rather than fail
            log.warning("torch.compile of the decode step failed; decoding eagerly", exc_info=True)
            self.compiled = None
            logits = self._logits(entry)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        entry.ran = True
        if self.compiled is not None:
            b, n_csa, n_hca = entry.batch.input_ids.shape[0], _reads(entry.meta.csa), _reads(entry.meta.hca)
            log.info("decode step batch %d (csa %d, hca %d rows) compiled: %.1f s", b, n_csa, n_hca, seconds)
        return logits

    def _logits(self, entry: StaticDecode) -> torch.Tensor:
        return self.model.compute_logits(self.model(entry.batch, self.cache, entry.meta))

    def _replay(self, entry: StaticDecode) -> None:
        if entry.graph is None:
            self._capture(entry)
        assert entry.graph is not None
        entry.graph.replay()

    def _capture(self, entry: StaticDecode) -> None:
        """Warm up on a side stream, then capture (the buffers already hold this step's inputs).

        A step's forward is idempotent (it rewrites the same slots with the same values), so the warm-up
        runs on the real step's inputs are harmless; the replay that follows computes the step.
        """
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(entry)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            entry.logits = self._forward(entry)
        entry.graph = graph
