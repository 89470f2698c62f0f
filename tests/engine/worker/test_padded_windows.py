"""Padded (static-shaped) window metadata runs the model exactly as the exact one does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.engine.core.scheduler import ScheduledRequest
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.worker.batch import build_forward_batch
from hybridserve.models.deepseek_v4 import DeepseekV4Model
from hybridserve.models.loader import load_model
from tests.tiny_models import SPECS, VOCAB

PROMPTS = (23, 9, 40)  # prompt lengths; chunks of 7 tokens, then greedy decode
CHUNK, DECODE_STEPS = 7, 20


def _left(r: Request) -> int:
    return r.num_tokens - r.num_computed_tokens


def _run(model: DeepseekV4Model, pad: bool) -> tuple[list[torch.Tensor], BlockPoolSet]:
    plan = build_plan(model.cache_specs(), 8, 4, 512, num_blocks=64)
    pools = BlockPoolSet(plan, "cpu")
    coord = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(f"r{i}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), SamplingParams())
        for i, n in enumerate(PROMPTS)
    ]
    logits = []
    for _ in range(-(-max(PROMPTS) // CHUNK) + DECODE_STEPS):
        step = [ScheduledRequest(r, r.num_computed_tokens, min(CHUNK, _left(r))) for r in reqs]
        for s in step:
            assert coord.allocate(s.request.request_id, s.start, s.end)
        batch = build_forward_batch(step, coord, torch.device("cpu"), pad_windows=pad)
        out = model.compute_logits(model(batch, pools.tensors())[batch.logits_indices])
        logits.append(out)
        sampling = [s.request for s in step if s.samples]
        for s in step:
            s.request.num_computed_tokens = s.end
        for r, row in zip(sampling, out, strict=True):
            r.output_token_ids.append(int(row.argmax()))
    return logits, pools


@pytest.mark.parametrize("name", ["mixed", "bf16", "csa_heavy"])
def test_padded_windows_give_bit_identical_logits(name: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    model = load_model(tiny_checkpoint(name), getattr(torch, SPECS[name].dtype), "cpu")
    exact, _ = _run(model, pad=False)
    padded, pools = _run(model, pad=True)
    assert len(exact) == len(padded)
    for a, b in zip(exact, padded, strict=True):
        assert torch.equal(a, b)
    for pool in pools.pools.values():  # padding wrote only zeros into the null block
        rows = pool.plan.rows_per_block
        for t in pool.tensors.values():
            assert not t[NULL_BLOCK * rows : (NULL_BLOCK + 1) * rows].any()
