"""ModelRunner: scheduled requests -> one ForwardBatch -> one forward -> logits -> sampled tokens."""

from __future__ import annotations

from collections import Counter

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.engine.batch import build_forward_batch
from hybridserve.engine.decode_graphs import DecodeGraphRunner
from hybridserve.engine.prefill_graphs import PrefillGraphRunner
from hybridserve.engine.prompt_logprobs import gather_prompt_logprobs
from hybridserve.engine.sampler import Sampler, SampleResult
from hybridserve.engine.scheduler import SchedulerOutput
from hybridserve.models.deepseek_v4 import DeepseekV4Model


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV4Model,
        pools: BlockPoolSet,
        coordinator: KvCacheCoordinator,
        sampler: Sampler,
        device: torch.device,
        decode_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        compile_decode: bool = False,
        compile_prefill: bool = False,
        keep_streams: bool = False,
    ) -> None:
        """``decode_graphs``: run pure-decode steps padded to bucketed static shapes (DecodeGraphRunner),
        replayed as CUDA graphs on CUDA unless ``enforce_eager``, through torch.compile if
        ``compile_decode``; ``compile_prefill``: the other steps through one dynamically shaped graph
        (PrefillGraphRunner), else the normal path; ``keep_streams``: the decode graphs keep each step's
        pre-head streams (a speculative engine's MTP layer reads them)."""
        self.model = model
        self.cache = pools.tensors()
        self.coordinator = coordinator
        self.sampler = sampler
        self.device = device
        self.decode_graphs: DecodeGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        self.steps_by_path: Counter[str] = Counter()  # see ``execute``
        max_len = max_model_len or model.cfg.max_position_embeddings
        if compile_prefill:
            self.prefill_graphs = PrefillGraphRunner(model, pools, coordinator, device, max_len)
        if decode_graphs:
            self.decode_graphs = DecodeGraphRunner(
                model,
                pools,
                coordinator,
                device,
                max_num_seqs,
                max_len,
                use_graphs=not enforce_eager,
                compiled=compile_decode,
                keep_streams=keep_streams,
            )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        """Run the step; one result per scheduled request that samples, in scheduling order. Counts it in
        ``steps_by_path``: "decode_graph" (a static decode step), "prefill_graph" (the compiled graph ran
        it), "prefill_graph_refused" (the graph's guards refused it: eager on its metadata), "eager"."""
        if self.decode_graphs is not None and self.decode_graphs.supports(out.scheduled):
            self.steps_by_path["decode_graph"] += 1
            return self._execute_decode(out, self.decode_graphs)
        if self.prefill_graphs is not None and self.prefill_graphs.supports(out.scheduled):
            batch, streams, path = self.prefill_graphs.run(out.scheduled)
        else:
            batch = build_forward_batch(out.scheduled, self.coordinator, self.device)
            streams, path = self.model(batch, self.cache), "eager"
        self.steps_by_path[path] += 1
        gather_prompt_logprobs(self.model, out.scheduled, streams)
        sampling = [s.request for s in out.scheduled if s.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(streams[batch.logits_indices])
        return self.sampler(logits, sampling)

    def _execute_decode(self, out: SchedulerOutput, graphs: DecodeGraphRunner) -> list[SampleResult]:
        logits = graphs.run(out.scheduled)
        rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        if not rows:
            return []
        if len(rows) < len(out.scheduled):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return self.sampler(logits, [out.scheduled[i].request for i in rows])
