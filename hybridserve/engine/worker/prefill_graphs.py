"""Prefill and mixed steps through one graph compiled with dynamic sizes (``--compile-prefill``).

A step that is not a pure decode (prompt chunks, alone or beside decoding requests) has shapes that
vary on many dims at once: tokens, requests, query blocks and their size, the compressed rows each block
reads and the windows the step completes. vLLM compiles its model once for a symbolic token count; here
the metadata varies too, so the step's metadata is built on the host in one uniform form
(``interface.MetaShapes``, DeepSeek-V4's: padded windows, the query rows always as an index, query
blocks of 2 or more, bucketed row reads; block tables of at least 2 rows and a power-of-two width), and
the forward runs through ``torch.compile(dynamic=True)``: every size is a symbol, the block size
included, so one graph serves every such step.

:meth:`PrefillGraphRunner.warmup` compiles that graph at start-up, on steps of dummy requests whose block
tables are all the null block (their writes land there and are zeroed after). Dynamo specialises what
the first trace happened to see equal, so the warm-up runs steps of unrelated sizes until one runs
without compiling. With inductor the graphs are traced ahead of time and kept on disk with their guards
(``saved_graphs``, as the decode graphs are): a restart's warm-up loads them and traces none. Serving
never traces: a step the graphs' guards refuse (a dim of size 1, an attention chunking no graph traced)
runs eagerly on the same metadata (dynamo's ``eager_on_recompile`` stance for ``torch.compile``).
Every step's metadata reads its one-token requests apart from the others' chunks (DeepSeek-V4's
``AttentionMeta.split``; a step without two decodes gets filler entries), so steps with and without
decodes share the graph. One-token steps take the plain eager path. The graph never runs every routed
expert for few tokens (``moe.without_all_experts``, as the decode graphs may): that guard would split it
in two, and few-token steps rarely reach it (decodes and
verify steps take the decode graphs). ``steps`` counts the compiled and the eager runs of the graph's
steps.

The logits, the prompt logprobs and the sampler stay outside the graph (they need few rows).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as fx_config

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.worker.batch import build_forward_batch
from hybridserve.engine.worker.decode_graphs import (
    MIN_ROW_BUCKET,
    least_indexed_rows,
    row_bucket,
    table_width,
)
from hybridserve.engine.worker.graph_calls import (
    CompileOnFirstCall,
    RecordingBackend,
    mark_static,
    static_pool_tensors,
    tracing,
)
from hybridserve.engine.worker.saved_graphs import SavedGraphs
from hybridserve.layers.forward_batch import BatchLayout, ForwardBatch, host_tensor
from hybridserve.layers.moe import without_all_experts
from hybridserve.models.interface import CacheTensors, MetaShapes, PagedModel

log = logging.getLogger(__name__)

GRAPH_BACKEND = "inductor"  # tests trace with dynamo's "eager" backend, which compiles nothing
BLOCK_SIZES = (2, 4, 8, 16, 32, 64)  # query blocks of one token would specialise a dim to 1
# Dummy steps of unrelated sizes (tokens per request, first position): the first trace specialises
# sizes it saw equal, the recompile marks them dynamic, the last must run without compiling.
# The second has real decodes where the first traced filler ones (``AttentionMeta.split``).
WARMUP_STEPS = (
    ((45, 61, 38), (0, 0, 0)),
    ((1, 57, 1, 1, 23), (9, 3, 130, 41, 0)),
    ((29, 53, 70, 17), (0, 37, 100, 5)),
    ((83, 22, 57), (11, 64, 3)),
)
MAX_WARMUP_STEPS = 5


def prefill_step(model: PagedModel[Any], batch: ForwardBatch, cache: CacheTensors, meta: Any) -> torch.Tensor:
    """The compiled function: a module-level function of its arguments, as a saved graph's must be."""
    return model(batch, cache, meta)


class PrefillGraphRunner:
    """Runs the forward of prefill and mixed steps through one dynamically shaped compiled graph."""

    def __init__(
        self,
        model: PagedModel[Any],
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.model, self.coordinator, self.device = model, coordinator, device
        self.cache: CacheTensors = pools.tensors()
        self.graph_cache: CacheTensors = pools.graph_tensors()
        self.null_rows = pools.null_rows()
        self.max_model_len = max_model_len
        self.group_names = [g.spec.name for g in coordinator.plan.groups]
        options = {"cpp_wrapper": True} if device.type == "cpu" else None
        self.recorder = RecordingBackend(GRAPH_BACKEND, options)
        self.compiled: SavedGraphs | CompileOnFirstCall = self._saved_graphs() or self._torch_compiled()
        self.enabled = True  # False once compiling failed: every step runs eagerly
        self.warmed = False
        self.min_tokens = 2  # fewer take the plain eager path
        self.compile_seconds = 0.0
        self.steps = {"compiled": 0, "eager": 0}

    def _saved_graphs(self) -> SavedGraphs | None:
        """The graphs traced ahead of time and kept on disk (``saved_graphs``), for inductor."""
        if GRAPH_BACKEND != "inductor":
            return None
        static = static_pool_tensors(self.graph_cache)
        model, device, recorder = self.model, self.device, self.recorder
        return SavedGraphs.of_step(prefill_step, "prefill", model, device, recorder, static, dynamic=True)

    def _torch_compiled(self) -> CompileOnFirstCall:
        # isolated: this runner's graph counts against its own recompile limit (see DecodeGraphRunner)
        return CompileOnFirstCall(
            prefill_step,
            partial(mark_static, static_pool_tensors(self.graph_cache)),
            dynamic=True,
            fullgraph=True,
            backend=self.recorder,
            isolate_recompiles=True,
        )

    def supports(self, scheduled: list[ScheduledRequest]) -> bool:
        """A step of prompt chunks (maybe beside decodes) or of drafts to verify (each request's last token
        and its drafts, a causal chunk like a prompt's) of at least ``min_tokens`` while compiling works
        (before the warm-up: any such step, which warms up first)."""
        if not self.enabled:
            return False
        return sum(s.num_tokens for s in scheduled) >= self.min_tokens

    @torch.inference_mode(False)
    @torch.no_grad()
    def run(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, torch.Tensor, str]:
        """(the step's batch, its pre-head streams [T, hc, D], how it ran): through the graph where its
        guards hold ("prefill_graph"), else eagerly on the same metadata ("prefill_graph_refused"); too few
        tokens, or compiling failed, on the plain path ("eager"). The first step warms up first if
        start-up did not."""
        if not self.warmed:
            self.warmup()
        if not self.enabled or sum(s.num_tokens for s in scheduled) < self.min_tokens:
            batch = build_forward_batch(scheduled, self.coordinator, self.device)
            return batch, self.model(batch, self.cache), "eager"
        batch = build_forward_batch(scheduled, self.coordinator, self.device, pad_windows=True)
        streams, compiled = self._streams(self._uniform(batch))
        return batch, streams, "prefill_graph" if compiled else "prefill_graph_refused"

    def warmup(self) -> float:
        """Compile the graph on dummy steps until one runs without compiling -> seconds (logged)."""
        start = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():
            self._warm(WARMUP_STEPS)
        if isinstance(self.compiled, SavedGraphs):
            self.compiled.compile_missing = False  # serving never traces: a step no graph takes runs eagerly
        self.warmed = True
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        how = "compiled" if self.enabled else "eager (compiling failed)"
        log.info("prefill steps %s in %.1f s", how, seconds)
        return seconds

    def _warm(self, steps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> None:
        for i in range(MAX_WARMUP_STEPS):
            lengths, starts = steps[min(i, len(steps) - 1)]
            traces = self._traces()
            if not self._warm_step(lengths, starts):
                return
            if i >= 1 and self._traces() == traces:
                return

    def _traces(self) -> int:
        """Graphs traced so far (by this runner's saved graphs, else by dynamo in this process)."""
        if isinstance(self.compiled, SavedGraphs):
            return self.compiled.traced
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    def _warm_step(self, lengths: tuple[int, ...], starts: tuple[int, ...]) -> bool:
        """One dummy step through the graph -> whether compiling works."""
        try:
            batch = self._uniform(self._dummy_batch(lengths, starts))
            # Without duck shaping, a size that happens to equal another (a bucketed row count and a head
            # dim) gets its own symbol, so the trace cannot specialise it along with the other. Only
            # traces need it: serving never traces (``eager_on_recompile``). The sizes that are equal by
            # construction the model states itself (``attention_meta.tie_shapes``).
            with fx_config.patch(use_duck_shape=False), tracing():  # type: ignore[attr-defined]
                self._call(batch, self._meta(batch))
        except Exception:  # a missing C++ compiler, an unsupported op: serve eagerly rather than fail
            if isinstance(self.compiled, SavedGraphs):
                log.warning("prefill steps cannot be saved traced; torch.compile traces them", exc_info=True)
                self.compiled = self._torch_compiled()
                return self._warm_step(lengths, starts)
            log.warning("torch.compile of prefill steps failed; they run eagerly", exc_info=True)
            self.enabled = False
        finally:
            torch._foreach_zero_(self.null_rows)
        return self.enabled

    def _streams(self, batch: ForwardBatch) -> tuple[torch.Tensor, bool]:
        """(streams, whether the graph ran them)."""
        with torch.compiler.set_stance("eager_on_recompile"):
            streams, compiled = self._call(batch, self._meta(batch))
        torch._foreach_zero_(self.null_rows)
        self.steps["compiled" if compiled else "eager"] += 1
        if not compiled:
            log.debug("a %d-token step ran eagerly: the graph's guards refused it", batch.num_tokens)
        return streams, compiled

    def _call(self, batch: ForwardBatch, meta: Any) -> tuple[torch.Tensor, bool]:
        """(streams, whether the compiled graph ran)."""
        with self.recorder.recording() as calls, without_all_experts():
            streams = self.compiled(self.model, batch, self.graph_cache, meta)
            if streams is None:  # no saved graph's guards hold (and none is traced): as eager_on_recompile
                streams = prefill_step(self.model, batch, self.graph_cache, meta)
        return streams, bool(calls)

    def _meta(self, batch: ForwardBatch) -> Any:
        return self.model.attention_meta(batch, self._shapes(batch.host_layout()))

    def _shapes(self, layout: BatchLayout) -> MetaShapes:
        """Query blocks of 2 or more; each compressed branch's reads padded to a bucket past the indexer's
        top-k, so that the graph never sees a branch keep every row (as the decode graphs do)."""
        rows = {
            branch: row_bucket(
                r.visible,
                self.max_model_len // r.tokens_per_row,
                least_indexed_rows(r.indexed) if r.indexed else MIN_ROW_BUCKET,
            )
            for branch, r in self.model.row_reads(layout).items()
        }
        return MetaShapes(BLOCK_SIZES, rows)

    def _uniform(self, batch: ForwardBatch) -> ForwardBatch:
        """Block tables of at least 2 rows and a power-of-two width >= 2, padded with the null block (a
        size of 1 would be specialised); ``seq_ends`` padded alike. The host layout keeps the real rows."""
        r, width = next(iter(batch.block_tables.values())).shape
        rows, cols = max(r, 2), table_width(width)
        pad = (0, cols - width, 0, rows - r)
        tables = {name: F.pad(t, pad, value=NULL_BLOCK) for name, t in batch.block_tables.items()}
        return replace(batch, block_tables=tables, seq_ends=F.pad(batch.seq_ends, (0, rows - r)))

    def _dummy_batch(self, lengths: tuple[int, ...], starts: tuple[int, ...]) -> ForwardBatch:
        """Requests of ``lengths`` tokens from positions ``starts``, every block the null block."""
        half = self.max_model_len // 2
        spans = [(min(s, half), min(s, half) + min(n, half)) for n, s in zip(lengths, starts, strict=True)]
        positions = [p for s, e in spans for p in range(s, e)]
        req = [r for r, (s, e) in enumerate(spans) for _ in range(s, e)]
        ends = [e for _, e in spans]
        vocab = self.model.info.vocab_size
        ids = [3 + p % max(1, vocab - 3) for p in positions]
        host = host_tensor(ids + positions + req + ends).to(self.device)
        t = len(ids)
        input_ids, pos, req_t, ends_t = host.split([t, t, t, len(ends)])
        shape, dev = (len(spans), 2), self.device  # one tensor per group, as real steps have
        tables = {g: torch.full(shape, NULL_BLOCK, dtype=torch.long, device=dev) for g in self.group_names}
        layout = BatchLayout(tuple(s for s, _ in spans), tuple(ends), pad_windows=True)
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        block = self.coordinator.block_tokens
        return ForwardBatch(input_ids, pos, req_t, ends_t, tables, block, empty, layout)
