"""MTP x disaggregation, the prefill side: a speculative prefill worker fills the prompt's MTP window rows
(draft group ``mtp_kv``) before its blocks wait for a decode worker, exactly as a co-located speculative
engine writes them, and hands them off with the other groups; it drafts nothing for a request that leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.kv_transfer.handoff import handoff_blocks
from hybridserve.models.attention_meta import MTP_KV
from tests.engine.spec_decode.spec_helpers import KV, mtp

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _core(folder: Path, **kwargs: object) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(folder), block_tokens=8, kv_cache_memory=KV, max_num_batched_tokens=16,
            speculative_config=mtp(2), **kwargs, enforce_eager=True,  # type: ignore[arg-type]
        )
    )  # fmt: skip


def _mtp_rows(core: EngineCore, request_id: str, num_tokens: int) -> torch.Tensor:
    """The MTP window rows of positions [0, num_tokens) in the handoff's blocks, every field."""
    pool = core.pools[MTP_KV]
    table = core.coordinator.block_tables(request_id)[MTP_KV]
    blocks = handoff_blocks(core.plan, num_tokens)[MTP_KV]
    rows = [table[b] * pool.plan.rows_per_block + r for b in blocks for r in range(pool.plan.rows_per_block)]
    first = blocks.start * core.plan.block_tokens
    keep = [row for pos, row in enumerate(rows, first) if pos < num_tokens]
    return torch.cat([t[torch.tensor(keep)].flatten() for t in pool.tensors.values()])


def test_prefill_worker_hands_off_the_prompts_mtp_window(mtp_checkpoint: Callable[[str], Path]) -> None:
    folder = mtp_checkpoint("mixed")
    prompt = [(5 * i + 3) % 200 + 5 for i in range(37)]  # three chunks, past the first MTP window block
    prefill = _core(folder, disaggregation_mode="prefill")
    prefill.add_request(Request("r", prompt, GREEDY, remote_decode=True))
    outputs = []
    while not outputs:
        outputs = [o for o in prefill.step() if o.request_id == "r"]
    (out,) = outputs
    assert out.kv_transfer is not None and out.finish_reason is not None and len(out.new_token_ids) == 1
    assert MTP_KV in handoff_blocks(prefill.plan, len(prompt)) and not prefill.scheduler.running
    colocated = _core(folder)
    colocated.add_request(Request("r", prompt, GREEDY))
    while colocated.stats.generation_tokens == 0:
        colocated.step()
    ours, theirs = _mtp_rows(prefill, "r", len(prompt)), _mtp_rows(colocated, "r", len(prompt))
    # The co-located engine's last k + 1 rows come from the whole MTP layer (it drafts from there), ours
    # from its KV projection alone: the same rows up to fp32 GEMM rounding.
    assert theirs.abs().min() > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert out.new_token_ids == colocated.requests["r"].output_token_ids[:1]
