"""ModelRunner: scheduled requests -> one ForwardBatch -> one forward -> logits -> sampled tokens."""

from __future__ import annotations

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.engine.batch import build_forward_batch
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
    ) -> None:
        self.model = model
        self.cache = pools.tensors()
        self.coordinator = coordinator
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        """Run the step; one result per scheduled request that samples, in scheduling order."""
        batch = build_forward_batch(out.scheduled, self.coordinator, self.device)
        streams = self.model(batch, self.cache)
        sampling = [s.request for s in out.scheduled if s.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(streams[batch.logits_indices])
        return self.sampler(logits, sampling)
