"""ModelRunner: scheduled requests -> one ForwardBatch -> one forward -> logits -> sampled tokens."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from hybridserve.engine.sample.ops import SampleResult
from hybridserve.engine.sample.sampler import Sampler
from hybridserve.engine.worker.batch import build_forward_batch
from hybridserve.engine.worker.compile_policy import EAGER, CompilePolicy
from hybridserve.engine.worker.compile_share import CompileShare
from hybridserve.engine.worker.decode_graphs import DecodeGraphRunner, DraftRows
from hybridserve.engine.worker.graph_readiness import DECODE, DRAFT, PREFILL, TAIL, GraphReadiness
from hybridserve.engine.worker.prefill_graphs import PrefillGraphRunner
from hybridserve.engine.worker.prompt_logprobs import gather_prompt_logprobs
from hybridserve.layers.hyper_connection import set_compile, warm_compiled_tail
from hybridserve.models.interface import PagedModel

log = logging.getLogger("hybridserve.engine")


class ModelRunner:
    def __init__(
        self,
        model: PagedModel[Any],
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        sampler: Sampler,
        device: torch.device,
        policy: CompilePolicy = EAGER,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        keep_streams: bool = False,
        tokens_per_request: int = 1,
    ) -> None:
        """``policy.decode_graphs``: run pure-decode steps padded to bucketed static shapes
        (DecodeGraphRunner), replayed as CUDA graphs on CUDA, through torch.compile if
        ``policy.compile_decode``; ``policy.compile_prefill``: the other steps through one dynamically
        shaped graph (PrefillGraphRunner), else the normal path; ``keep_streams``: the decode graphs keep
        each step's pre-head streams (a speculative engine's MTP layer reads them);
        ``tokens_per_request``: the most tokens a request computes in a step the decode graphs run (a
        speculative engine's 1 + k: its verify steps)."""
        self.model = model
        self.cache = pools.tensors()
        self.coordinator = coordinator
        self.sampler = sampler
        self.device = device
        self.decode_graphs: DecodeGraphRunner | None = None
        self.draft_graphs: DecodeGraphRunner | None = None  # the MTP layer's steps (compiled, speculative)
        self.prefill_graphs: PrefillGraphRunner | None = None
        self.steps_by_path: Counter[str] = Counter()  # see ``execute``
        self.drafts_by_path: Counter[str] = Counter()  # the MTP layer's forwards: "graph" or "eager"
        self.policy = policy
        self.graphs = GraphReadiness()
        self.compile_share = CompileShare()  # the background compile pauses for steps (see its module)
        max_len = max_model_len or model.info.max_position_embeddings
        if policy.compile_prefill:
            self.prefill_graphs = PrefillGraphRunner(model, pools, coordinator, device, max_len)
        static = partial(
            DecodeGraphRunner,
            model,
            pools,
            coordinator,
            device,
            max_num_seqs,
            max_len,
            tokens_per_request=tokens_per_request,
        )
        if policy.decode_graphs:
            self.decode_graphs = static(compiled=policy.compile_decode, keep_streams=keep_streams)
        if policy.compile_decode and keep_streams and model.info.num_draft_layers:
            # the MTP layer's rows: each drafting request's last verified position (the step's others
            # write only their window rows, in the same graph), then one a depth
            self.draft_graphs = static(compiled=True, draft=True)

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (and on CUDA capture) the mHC tail, the decode step and the prefill graph before the
        first request, and say how long; ``progress`` hears the name of each part once it is ready."""
        for name, warm in self._warmup_parts():
            self._warm_part(name, warm)
            if progress is not None:
                progress(name)
        self.graphs.all_ready()

    def start_background_warmup(self) -> threading.Thread:
        """``warm_beside_steps`` in a thread of its own. Steps in the calling thread run slower beside it
        (see ``compile_share``): the engine-core process compiles in its main thread instead."""
        self.graphs.start_gating()
        thread = threading.Thread(target=self.warm_beside_steps, name="compile-steps", daemon=True)
        thread.start()
        return thread

    def warm_beside_steps(self) -> None:
        """``warmup`` while steps run eagerly in another thread (after ``graphs.start_gating``): each part
        takes over once it is compiled (see ``GraphReadiness``); the log and ``graphs.ready`` say when,
        and when the engine reached full speed. Under ``compile_share.compiling()`` the compile pauses
        for each step and stops once abandoned."""
        if self._warm_parts_beside_steps():
            after = self.graphs.all_ready()
            log.info("full speed: every compiled step ready %.1f s after start-up", after)

    def _warm_parts_beside_steps(self) -> bool:
        try:
            for name, warm in self._warmup_parts():
                if self.compile_share.abandoned:
                    return False
                with self.graphs.compiling():
                    self._warm_part(name, warm)
        except Exception:  # the engine keeps serving eagerly
            log.exception("compiling the steps in the background failed; they run eagerly")
            return False
        return True

    def _warm_part(self, name: str, warm: Callable[[], str | None]) -> None:
        start = time.perf_counter()
        how = warm()
        if how is not None:
            log.info("%s ready in %.1f s%s", name, time.perf_counter() - start, how)
        self.graphs.ready(name)

    def warmup_part_count(self) -> int:
        return len(self._warmup_parts())

    def _warmup_parts(self) -> list[tuple[str, Callable[[], str | None]]]:
        """(name, compile it -> a note for the log, or None when there was nothing to compile); the decode
        step first: most steps of a busy server are pure decodes."""
        parts: list[tuple[str, Callable[[], str | None]]] = []
        if self.policy.compile_tail:
            parts.append((TAIL, self._warm_tail))
        prefill, decode = self.prefill_graphs, self.decode_graphs
        if decode is not None:
            parts.append((DECODE, lambda: (decode.warmup(), _decode_how(decode))[1]))
        if (draft := self.draft_graphs) is not None:
            parts.append((DRAFT, lambda: (draft.warmup(), _decode_how(draft))[1]))
        if prefill is not None:
            parts.append((PREFILL, lambda: (prefill.warmup(), None)[1]))  # it logs its own time
        return parts

    def _warm_tail(self) -> str | None:
        warmed = warm_compiled_tail(self.model.modules(), self.device, self.model.dtype)
        set_compile(True)
        return "" if warmed else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        """Run the step; one result per scheduled request that samples, in scheduling order."""
        logits, _ = self.forward(out.scheduled)
        sampling = [s.request for s in out.scheduled if s.samples]
        return self.sampler(logits, sampling) if sampling else []

    def forward(
        self, scheduled: list[ScheduledRequest], keep_streams: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forward -> (logits of the rows that sample, in order; its pre-head streams [T, hc, D]
        if ``keep_streams``, which a decode graph needs built with ``keep_streams``). Counts it in
        ``steps_by_path``: "decode_graph" (a static decode step), "prefill_graph" (the compiled graph ran
        it), "prefill_graph_refused" (the graph's guards refused it: eager on its metadata), "eager"."""
        with self.graphs.use() as ready:
            decode, prefill = self.decode_graphs, self.prefill_graphs
            if decode is not None and DECODE in ready and decode.supports(scheduled):
                self.steps_by_path["decode_graph"] += 1
                return self._decode_graph(scheduled, decode, keep_streams)
            if prefill is not None and PREFILL in ready and prefill.supports(scheduled):
                batch, streams, path = prefill.run(scheduled)
            else:
                batch = build_forward_batch(scheduled, self.coordinator, self.device)
                streams, path = self.model(batch, self.cache), "eager"
        self.steps_by_path[path] += 1
        gather_prompt_logprobs(self.model, scheduled, streams)
        kept = streams if keep_streams else None
        if not any(s.samples for s in scheduled):
            return streams.new_zeros(0), kept
        return self.model.compute_logits(streams[batch.logits_indices]), kept

    @torch.inference_mode()
    def draft(self, rows: DraftRows, kv: DraftRows | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MTP layer's ``rows`` through the draft graph (``DecodeGraphRunner.run_draft``; ``kv``: rows
        that first write only their window row) -> (draft logits, its streams); None where there is none,
        it is not compiled yet or the rows do not fit: the caller runs the layer (and writes ``kv``) eagerly.
        Counted in ``drafts_by_path``."""
        with self.graphs.use() as ready:
            graphs = self.draft_graphs
            most = self.max_draft_rows
            fits = len(rows.ids) <= most and (kv is None or len(kv.ids) <= most)
            if graphs is not None and DRAFT in ready and fits:
                self.drafts_by_path["graph"] += 1
                return graphs.run_draft(rows, kv)
        self.drafts_by_path["eager"] += 1
        return None

    @property
    def max_draft_rows(self) -> int:
        """The most rows of each kind a draft graph step takes (0: no draft graphs)."""
        return 0 if self.draft_graphs is None else self.draft_graphs.buckets[-1]

    def _decode_graph(
        self, scheduled: list[ScheduledRequest], graphs: DecodeGraphRunner, keep_streams: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        streams = None
        if keep_streams:
            logits, streams = graphs.run_keeping_streams(scheduled)
        else:
            logits = graphs.run(scheduled)
        rows = sampled_rows(scheduled)
        if len(rows) < logits.shape[0]:
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        return logits, streams


def _decode_how(graphs: DecodeGraphRunner) -> str:
    how = ["torch.compile"] * (graphs.compiled is not None) + ["CUDA graphs"] * graphs.use_graphs
    return f" ({', '.join(how) or 'eager'})"


def sampled_rows(scheduled: list[ScheduledRequest]) -> list[int]:
    """The rows of a step's tokens whose logits it samples from: each sampling request's last known token
    and its drafts (``build_forward_batch``'s ``logits_indices``)."""
    rows: list[int] = []
    offset = 0
    for s in scheduled:
        offset += s.num_tokens
        if s.samples:
            rows += range(offset - 1 - s.num_spec, offset)
    return rows
