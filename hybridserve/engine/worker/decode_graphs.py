"""Static-shaped decode steps, bucketed by batch size, replayed as CUDA graphs (vLLM's scheme).

A step is a batch of one-token rows: a pure-decode step's requests, or (``tokens_per_request`` > 1) the
1 + k tokens of each request of a speculative verify step, each token a row with its request's tables
at its own position (each layer writes the whole step before any row reads, so a later row sees its
request's earlier ones, as in a prefill chunk). R rows are padded to the next bucket B in (1, 2, 4, ...,
max_num_seqs x tokens_per_request) with dummy rows: position 0, every block-table entry the null block,
token id 0. A ``draft`` runner runs the MTP layer's rows the same way (``run_draft``: its input streams
in one more buffer; the draft group's table only), after K >= 2 rows (padded like B, a dim of its own) that
only write their window row: the verified positions no draft starts from.

The step copies only its token ids, positions and block tables (padded to a power-of-two width) into the
persistent buffers of its shape key (B, N per compressed branch, table width); each branch's row reads
(``PagedModel.row_reads``) are padded to a bucketed row count N (powers of two, at most ``max_model_len //
m``). The attention metadata is built from those buffers inside the step (``PagedModel.decode_meta``;
DeepSeek-V4: one compressed-window entry per request and branch, no host layout), then the forward, the
logits of all B rows and the re-zeroing of the null blocks run: as one captured ``torch.cuda.CUDAGraph`` per
key on CUDA, eagerly (or compiled) elsewhere.

Dummy rows write their own token's inputs into row 0 of the null block of every per-token group (and
the window-padding entries then pool them into the null row of the compressed groups). Nothing reads
the null block unmasked (invisible keys get zero weight, and the values are finite), so real rows are
unaffected; the null blocks are zeroed again at the end of every padded step, which keeps the padded
window design's invariant (the null block is all zeros) between steps.

With ``compiled`` the metadata, forward and logits of the static step run through ``torch.compile``
(inductor: C++ loops on CPU, Triton on CUDA), which fuses the ~2,000 small ops of a decode step into a
few dozen kernels. The batch dim (B > 1), the table width and the row counts are marked dynamic, so one
graph serves batch 1 and one every other bucket, at every context; once a key's graph has taken the
same inputs twice, the key calls it directly, without dynamo (``engine/worker/graph_calls.py``). On CPU the
routed experts run inside the graph as the opaque ``hybridserve::grouped_experts`` op (``layers/moe.py``),
the eager grouped path's own ops, except where a batch of few tokens runs every expert in two GEMMs
(``PagedModel.prepare_compiled_decode``: small fp32 experts, E <= 4k; its batch-size guard splits the
dynamic graph in two, both compiled by :meth:`warmup`). The cache writes are ``index_put_`` (which
inductor keeps in place; an ``index_copy_`` into a graph input becomes a copy of the whole pool tensor),
and the null-block zeroing runs eagerly after the graph for the same reason.
On CPU the generated code's wrapper (which allocates the buffers and calls the kernels) is C++ too
(inductor's ``cpp_wrapper``). Compiling happens on the first step of each graph (or in
:meth:`DecodeGraphRunner.warmup`); its time is logged and kept in ``compile_seconds``, and inductor caches
the generated code on disk (``TORCHINDUCTOR_CACHE_DIR``), so a restart with the same model compiles much
faster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.worker.graph_calls import (
    CompileOnFirstCall,
    DirectCall,
    GraphCall,
    RecordingBackend,
    direct_call,
    mark_static,
    static_pool_tensors,
    tracing,
)
from hybridserve.engine.worker.prompt_logprobs import gathers_prompt_logprobs
from hybridserve.engine.worker.saved_graphs import SavedGraphs
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.models.interface import CacheTensors, PagedModel, RowReads

log = logging.getLogger(__name__)

MIN_ROW_BUCKET = 16
MIN_KV_ROWS = 2  # a draft step's window-only rows, padded (a dim of 1 would be specialised)
GRAPH_BACKEND = "inductor"  # what compiles the static step (tests trace some with dynamo's "eager")
BATCH_STEP = 8


def batch_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8 below ``max_num_seqs``, then itself."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += range(BATCH_STEP, max_num_seqs, BATCH_STEP)
    return [*sizes, max_num_seqs]


def row_bucket(n: int, most: int, least: int = MIN_ROW_BUCKET) -> int:
    """The padded compressed-row count for ``n`` rows: a power of two >= ``least``, capped at ``most``."""
    return min(max(least, 1 << max(n - 1, 0).bit_length()), max(most, n))


def least_indexed_rows(index_topk: int) -> int:
    """The fewest rows a compiled step's CSA reads: more than ``index_topk`` (padded rows are never
    visible), so the indexer keeps ``topk`` of them at every context and one graph serves all (traced at
    ``topk`` rows or fewer, the graph would be specialised to keeping every row)."""
    return max(MIN_ROW_BUCKET, 1 << index_topk.bit_length())


def table_width(width: int) -> int:
    """The padded block-table width: a power of two >= 2 (a size-1 dim would be specialised)."""
    return max(2, 1 << max(width - 1, 0).bit_length())


@dataclass
class DraftRows:
    """Rows of a draft step: row i at ``positions[i]`` from ``streams[i]`` (the trunk's, or the draft
    layer's own) and the next token ``ids[i]``, with its request's ``tables[i]``."""

    streams: torch.Tensor
    ids: list[int]
    positions: list[int]
    tables: list[dict[str, list[int]]]


def _fill(batch: ForwardBatch, ids: list[int], positions: list[int], tables: torch.Tensor) -> None:
    """Copy rows (token, position) and their packed tables [G, B, width] into a key's buffers; the rows
    past them are dummies: token 0 at position 0, null tables."""
    b = batch.input_ids.shape[0]
    pad = [0] * (b - len(ids))
    host = host_tensor(ids + pad + positions + pad + [p + 1 for p in positions] + [1] * len(pad)).view(3, b)
    for dst, src in zip((batch.input_ids, batch.positions, batch.seq_ends), host, strict=True):
        dst.copy_(src)
    for dst, src in zip(batch.block_tables.values(), tables, strict=True):
        dst.copy_(src)


@dataclass
class StaticDecode:
    """The persistent buffers (and, on CUDA, the graph) of one shape key. The step's metadata is built
    from them inside the step (``PagedModel.decode_meta``), so a step copies in only its token ids,
    positions and block tables."""

    batch: ForwardBatch  # [B] ids, positions, ends; [B, width] block tables; no host layout
    rows: dict[str, torch.Tensor]  # per compressed branch: arange(N) of its row reads
    logits: torch.Tensor | None = None  # [B, V], written by every run
    streams: torch.Tensor | None = None  # [B, hc, D] pre-head streams, written by every run if kept
    inputs: torch.Tensor | None = None  # [B, hc, D] a draft step's input streams (the trunk's or its own)
    kv: ForwardBatch | None = None  # a draft step's [K] rows that only write their window row, K >= 2
    kv_inputs: torch.Tensor | None = None  # [K, hc, D] their input streams
    graph: torch.cuda.CUDAGraph | None = None
    ran: bool = False  # the first run of a key may compile
    calls: list[GraphCall] = field(default_factory=list)  # the graph calls of the key's last compiled run
    direct: DirectCall | None = None  # the key's graph and its inputs, once they proved the same twice

    def mark_dynamic(self) -> None:
        """The batch dim (B > 1), the table width and the compressed-row dims as dynamic: one compiled
        graph for batch 1 and one for every other bucket, whatever the context, so serving never stops to
        compile."""
        b = self.batch.input_ids.shape[0]
        per_token = (self.batch.input_ids, self.batch.positions, self.batch.req_indices, self.batch.seq_ends)
        for t in (*per_token, self.batch.logits_indices, *self.batch.block_tables.values()):
            if b > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for table in self.batch.block_tables.values():
            torch._dynamo.maybe_mark_dynamic(table, 1)
        for ids in self.rows.values():
            torch._dynamo.maybe_mark_dynamic(ids, 0)
        for streams in (self.streams, self.inputs):
            if streams is not None and b > 1:
                torch._dynamo.maybe_mark_dynamic(streams, 0)
        if self.kv is not None and self.kv_inputs is not None:
            for t in (self.kv.input_ids, self.kv.positions, self.kv.req_indices, self.kv_inputs):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            for table in self.kv.block_tables.values():
                torch._dynamo.maybe_mark_dynamic(table, 0)
                torch._dynamo.maybe_mark_dynamic(table, 1)


def trunk_step(
    model: PagedModel[Any],
    batch: ForwardBatch,
    rows: dict[str, torch.Tensor],
    cache: CacheTensors,
    max_model_len: int,
    streams_out: torch.Tensor | None,
) -> torch.Tensor:
    """The static step of the trunk: metadata, forward, logits of every row (``streams_out``: where its
    pre-head streams are kept). A function of its arguments only, as a graph kept on disk must be."""
    meta = model.decode_meta(batch, rows, max_model_len)
    streams = model(batch, cache, meta)
    if streams_out is not None:
        streams_out.copy_(streams)
    return model.compute_logits(streams)


def draft_step(
    model: PagedModel[Any],
    inputs: torch.Tensor,
    batch: ForwardBatch,
    cache: CacheTensors,
    max_model_len: int,
    streams_out: torch.Tensor,
    kv_inputs: torch.Tensor | None,
    kv: ForwardBatch | None,
) -> torch.Tensor:
    """The static step of the draft layer over rows from ``inputs``, after the ``kv`` rows that only
    write their window row; its streams kept in ``streams_out``."""
    kv_rows = None if kv is None or kv_inputs is None else (kv_inputs, kv)
    streams = model.mtp_decode(inputs, batch, cache, max_model_len, kv=kv_rows)
    streams_out.copy_(streams)
    return model.mtp_logits(streams)


class DecodeGraphRunner:
    """Runs pure-decode steps padded to static shapes; ``use_graphs`` captures and replays on CUDA."""

    def __init__(
        self,
        model: PagedModel[Any],
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool = True,
        batch_sizes: list[int] | None = None,
        pad_rows: bool = True,
        compiled: bool = False,
        keep_streams: bool = False,
        tokens_per_request: int = 1,
        draft: bool = False,
    ) -> None:
        """``batch_sizes``: the row buckets (default ``batch_buckets`` of ``max_num_seqs`` x
        ``tokens_per_request``, the most tokens a request computes in a step the graphs run: 1 + k in a
        speculative engine, whose verify steps then run here too); ``pad_rows``: bucket N (else exact);
        ``compiled``: the static step through ``torch.compile`` (see the module docstring);
        ``keep_streams``: every step also copies its pre-head streams into a buffer of its key (the MTP
        layer of a speculative engine reads them, ``run_keeping_streams``); ``draft``: the steps are the
        draft (MTP) layer's over the draft group (``run_draft``), not the trunk's."""
        self.model, self.coordinator, self.device = model, coordinator, device
        self.draft = draft
        self.keep_streams = keep_streams or draft
        self.cache: CacheTensors = pools.graph_tensors() if compiled else pools.tensors()
        self.tokens_per_request = tokens_per_request
        self.buckets = sorted(batch_sizes or batch_buckets(max_num_seqs * tokens_per_request))
        self.pad_rows = pad_rows
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs and device.type == "cuda"
        self.null_rows = pools.null_rows()
        groups = [g.spec.name for g in coordinator.plan.groups]
        self.group_names = [model.info.draft_group or ""] if draft else groups
        for rotary in model.rotary().values():  # the step looks positions up in tables that never grow
            rotary.reserve(max_model_len + 1)
        self.entries: dict[tuple[int, ...], StaticDecode] = {}  # (B, N per branch..., table width)
        self._last: StaticDecode | None = None  # the key of the latest step
        self.graph_pool: Any = None
        self.compiled: Callable[..., torch.Tensor] | None = None  # called with ``_args(entry)``
        # On CPU the generated C++ also calls the kernels (cpp_wrapper): a Python wrapper spent ~0.5 ms a
        # step allocating, viewing and checking buffers, a quarter of a batch-1 step.
        options = {"cpp_wrapper": True} if device.type == "cpu" else None
        self.recorder = RecordingBackend(GRAPH_BACKEND, options)
        if compiled:
            self.compiled = self._saved_graphs() or self._torch_compiled()
            model.prepare_compiled_decode()
        self.compile_seconds = 0.0  # wall time of the first runs of new keys (compiles included)

    def _saved_graphs(self) -> SavedGraphs | None:
        """The step's graphs traced ahead of time and kept on disk (``saved_graphs``), for inductor."""
        if GRAPH_BACKEND != "inductor":
            return None
        name = "draft" if self.draft else "decode"
        static = static_pool_tensors(self.cache)
        return SavedGraphs.of_step(self._step_fn(), name, self.model, self.device, self.recorder, static)

    def _torch_compiled(self) -> Callable[..., Any]:
        # Every runner compiles the one function: isolated, its graphs count against its own recompile
        # limit, not against one that every engine of the process shares (the ninth one failed).
        return CompileOnFirstCall(
            self._step_fn(),
            partial(mark_static, static_pool_tensors(self.cache)),
            dynamic=None,
            backend=self.recorder,
            isolate_recompiles=True,
        )

    def _step_fn(self) -> Callable[..., torch.Tensor]:
        return draft_step if self.draft else trunk_step

    def _args(self, entry: StaticDecode) -> tuple[Any, ...]:
        """What the step function of this runner reads: the model, the key's buffers, the cache."""
        if self.draft:
            return (
                self.model,
                entry.inputs,
                entry.batch,
                self.cache,
                self.max_model_len,
                entry.streams,
                entry.kv_inputs,
                entry.kv,
            )
        return (self.model, entry.batch, entry.rows, self.cache, self.max_model_len, entry.streams)

    def supports(self, scheduled: list[ScheduledRequest]) -> bool:
        """A step whose requests compute at most ``tokens_per_request`` tokens each (decodes; in a
        speculative engine a token and the drafts it verifies; short prompt chunks) and gather no prompt
        logprobs (the static step computes none), in no more rows than the largest bucket."""
        short = all(s.num_tokens <= self.tokens_per_request for s in scheduled)
        short = short and not any(gathers_prompt_logprobs(s) for s in scheduled)
        return bool(scheduled) and short and sum(s.num_tokens for s in scheduled) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def warmup(self) -> float:
        """Run dummy-only steps of batch 1, 2 and the largest bucket, so serving starts compiled; seconds.
        Batch 1 has its own graph and batch 2 one with the batch dim dynamic; a compiled CPU step that runs
        all experts for few tokens guards the batch size, and the largest bucket compiles its other side."""
        start = time.perf_counter()
        for size in dict.fromkeys([*self.buckets[:2], self.buckets[-1]]):
            self.run([], size)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest], size: int = 0) -> torch.Tensor:
        """Logits [T, V] of every token the scheduled requests compute, in order; the rows padded to the
        bucket of ``max(T, size)`` with dummies (position 0, token 0, all-null tables).

        Every token is a row of its own, its request's table repeated: a request's rows sit at consecutive
        positions, and each layer writes the whole step's window KV, compressor inputs and completed rows
        before any row reads, so a later row sees the earlier ones as a prefill chunk's tokens do."""
        ids: list[int] = []
        positions: list[int] = []
        tables: list[dict[str, list[int]]] = []
        for s in scheduled:
            ids += s.token_ids if s.num_spec else s.request.all_token_ids[s.start : s.end]
            positions += range(s.start, s.end)
            tables += [self.coordinator.block_tables(s.request.request_id)] * s.num_tokens
        return self._step(ids, positions, tables, size)

    @torch.inference_mode()
    def run_draft(self, rows: DraftRows, kv: DraftRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer (``draft``) over T ``rows`` -> (draft logits [T, V], the layer's streams [T, hc,
        D]), views of the key's buffers (valid until it runs again). ``kv``: rows that only write their
        window row (``PagedModel.mtp_write_kv``) first, in the same step: positions no draft starts from."""
        assert self.draft, "built for the trunk's steps"
        t = len(rows.ids)
        logits = self._step(rows.ids, rows.positions, rows.tables, 0, rows.streams, kv)
        assert self._last is not None and self._last.streams is not None
        return logits, self._last.streams[:t]

    def _step(
        self,
        ids: list[int],
        positions: list[int],
        tables: list[dict[str, list[int]]],
        size: int,
        inputs: torch.Tensor | None = None,
        kv: DraftRows | None = None,
    ) -> torch.Tensor:
        """One padded static step over rows (token, position, tables) -> the rows' logits."""
        t = len(ids)
        b = self.bucket(max(t, size))
        layout = BatchLayout(tuple(positions), tuple(p + 1 for p in positions))
        rows = {} if self.draft else self._row_reads(layout)
        if self.draft and kv is None:  # every draft step has window-only rows (a graph of its own else)
            kv = DraftRows(torch.empty(0), [], [], [])
        k = 0 if kv is None else max(MIN_KV_ROWS, self.bucket(len(kv.ids)))
        width = self._width([*tables, *(kv.tables if kv is not None else [])])
        # Compiled graphs take no inference tensors: the persistent buffers are normal ones.
        with torch.inference_mode(False), torch.no_grad():
            entry = self._entry((b, *rows.values(), *[k] * (kv is not None), width), rows, k)
            _fill(entry.batch, ids, positions, self._tables(tables, b, width))
            if inputs is not None:
                assert entry.inputs is not None
                entry.inputs[:t].copy_(inputs)
            if kv is not None:
                assert entry.kv is not None and entry.kv_inputs is not None
                _fill(entry.kv, kv.ids, kv.positions, self._tables(kv.tables, k, width))
                if kv.ids:
                    entry.kv_inputs[: len(kv.ids)].copy_(kv.streams)
            if self.use_graphs:
                self._replay(entry)
            else:
                entry.logits = self._forward(entry)
        assert entry.logits is not None
        self._last = entry
        return entry.logits[:t]

    def _row_reads(self, layout: BatchLayout) -> dict[str, int]:
        return {name: self._rows(reads) for name, reads in self.model.row_reads(layout).items()}

    def run_keeping_streams(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """``run``, and the step's pre-head streams [T, hc, D] (a view of the key's buffer: valid until the
        key runs again); needs ``keep_streams``."""
        logits = self.run(scheduled)
        assert self._last is not None and self._last.streams is not None, "built without keep_streams"
        return logits, self._last.streams[: logits.shape[0]]

    def _rows(self, reads: RowReads) -> int:
        """The padded row count N of a compressed branch."""
        if not self.pad_rows:
            return reads.visible
        most = self.max_model_len // reads.tokens_per_row
        indexed = reads.indexed and self.compiled is not None
        least = least_indexed_rows(reads.indexed) if indexed else MIN_ROW_BUCKET
        return row_bucket(reads.visible, most, least)

    def _width(self, tables: list[dict[str, list[int]]]) -> int:
        return table_width(max([1, *(len(t[name]) for t in tables for name in self.group_names)]))

    def _tables(self, tables: list[dict[str, list[int]]], b: int, width: int) -> torch.Tensor:
        """Every group's [B, width] table (host, [G, B, width]) from each row's tables; dummy rows and
        padding null."""
        flat: list[int] = []
        for name in self.group_names:
            for t in tables:
                flat += t[name] + [NULL_BLOCK] * (width - len(t[name]))
            flat += [NULL_BLOCK] * (width * (b - len(tables)))
        return host_tensor(flat).view(len(self.group_names), b, width)

    def _entry(self, key: tuple[int, ...], rows: dict[str, int], kv_rows: int = 0) -> StaticDecode:
        if key not in self.entries:
            self.entries[key] = self._new_entry(key[0], rows, key[-1], kv_rows)
            if self.compiled is not None:
                self.entries[key].mark_dynamic()
        return self.entries[key]

    def _new_entry(self, b: int, rows: dict[str, int], width: int, kv_rows: int = 0) -> StaticDecode:
        """Contiguous buffers of one key (strides follow from the shapes, so stride guards always hold)."""
        dev = self.device
        row_ids = {name: torch.arange(n, device=dev) for name, n in rows.items()}

        def streams_of(n: int) -> torch.Tensor:
            return torch.zeros((n, *self.model.info.stream_shape), dtype=self.model.dtype, device=dev)

        entry = StaticDecode(self._buffers(b, width), row_ids)
        entry.streams = streams_of(b) if self.keep_streams else None
        entry.inputs = streams_of(b) if self.draft else None
        if kv_rows:
            entry.kv, entry.kv_inputs = self._buffers(kv_rows, width), streams_of(kv_rows)
        return entry

    def _buffers(self, b: int, width: int) -> ForwardBatch:
        """A batch of B one-token rows (row i request i of the tables), zeros."""

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        req = torch.arange(b, device=self.device)
        return ForwardBatch(
            input_ids=ints(b),
            positions=ints(b),
            req_indices=req,
            seq_ends=ints(b),
            block_tables={name: ints(b, width) for name in self.group_names},
            block_tokens=self.coordinator.block_tokens,
            logits_indices=req,
        )

    def _forward(self, entry: StaticDecode) -> torch.Tensor:
        """The static step: forward and logits of all B rows, then the null blocks zeroed again."""
        if not entry.ran:
            logits = self._first_run(entry)
        elif self.compiled is not None:
            logits = self._replay_compiled(entry)
        else:
            logits = self._logits(entry)
        torch._foreach_zero_(self.null_rows)
        return logits

    def _replay_compiled(self, entry: StaticDecode) -> torch.Tensor:
        """A key's later runs: its graph called directly once that is proven sound (``direct_call``), else
        through dynamo with its guards skipped (~0.5 ms a step): the key's first run passed them with these
        very buffers, whose shapes, strides and dtypes never change, so they hold; only the guards that
        choose between the graphs (batch 1 or not) still run."""
        if entry.direct is not None:
            return entry.direct()
        if not entry.calls:  # dynamo ran the key's first run eagerly (``_first_run``): no guards to skip
            return self._logits(entry)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._compiled_run(entry)

    def _compiled_run(self, entry: StaticDecode) -> torch.Tensor:
        assert self.compiled is not None
        with self.recorder.recording() as calls:
            logits = self.compiled(*self._args(entry))
        entry.direct = direct_call(entry.calls, calls, logits)
        entry.calls = calls
        return logits

    def _first_run(self, entry: StaticDecode) -> torch.Tensor:
        """The key's first run, timed (it compiles a graph if none fits); eager if compiling fails."""
        start = time.perf_counter()
        try:
            logits = self._traced_run(entry)
        except Exception:  # a missing C++ compiler, an unsupported op: serve eagerly rather than fail
            log.warning("torch.compile of the decode step failed; decoding eagerly", exc_info=True)
            self.compiled = None
            logits = self._logits(entry)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        entry.ran = True
        if self.compiled is not None and not entry.calls:
            log.warning("dynamo compiled no graph for a decode step (its recompile limit?); it runs eagerly")
        elif self.compiled is not None:
            rows = ", ".join(f"{name} {len(r)}" for name, r in entry.rows.items()) or "no compressed"
            b = entry.batch.input_ids.shape[0]
            what = "draft" if self.draft else "decode"
            log.info("%s step batch %d (%s rows) compiled: %.1f s", what, b, rows, seconds)
        return logits

    def _traced_run(self, entry: StaticDecode) -> torch.Tensor:
        """A run that may trace: a step that saved graphs cannot take (``SavedGraphs`` raised) is
        compiled by ``torch.compile`` from then on."""
        with tracing():
            if self.compiled is None:
                return self._logits(entry)
            try:
                return self._compiled_run(entry)
            except Exception:
                if not isinstance(self.compiled, SavedGraphs):
                    raise
                log.warning("the decode step cannot be saved traced; torch.compile traces it", exc_info=True)
                self.compiled = self._torch_compiled()
                return self._compiled_run(entry)

    def _logits(self, entry: StaticDecode) -> torch.Tensor:
        return self._step_fn()(*self._args(entry))

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
