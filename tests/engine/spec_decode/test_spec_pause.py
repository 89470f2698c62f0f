"""After plain steps (load control turned drafting off, the MTP window rows of their positions unwritten),
speculative steps that draft nothing for the request rebuild its window; when drafting resumes, the draft
reads a whole window of written rows and equals the draft of a run that never paused."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain, repeat
from pathlib import Path

import torch

from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.models.attention_meta import MTP_KV
from tests.engine.spec_decode.spec_helpers import mtp
from tests.tiny_models import VOCAB

K = 2
PLAN = [K, K, 0, 0, 0, 0, 0, 0, 0]  # drafts chosen per step: a stretch of plain steps, then K again
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _core(folder: Path) -> EngineCore:
    config = EngineConfig(
        model=str(folder), kv_cache_memory="32MiB", speculative_config=mtp(K), enforce_eager=True
    )
    return EngineCore(config)


def _mtp_rows(core: EngineCore, req: Request, positions: range) -> torch.Tensor:
    """The MTP layer's window KV rows of ``req`` at ``positions`` (all fields, concatenated)."""
    pool = core.pools[MTP_KV]
    per_block = pool.plan.rows_per_block
    table = core.coordinator.block_tables(req.request_id)[MTP_KV]
    slots = [table[p // per_block] * per_block + p % per_block for p in positions]
    assert NULL_BLOCK not in [table[p // per_block] for p in positions]
    return torch.cat([t[torch.tensor(slots)].flatten(1).float() for t in pool.tensors.values()], dim=1)


def test_drafts_after_plain_steps_equal_those_of_a_run_that_never_paused(
    mtp_checkpoint: Callable[[str], Path],
) -> None:
    folder = mtp_checkpoint("mixed")
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    paused = _core(folder)
    choices = chain(PLAN, repeat(K))
    paused.spec.control.choose = lambda n, ready=None: next(choices)  # type: ignore[union-attr, method-assign]
    req = Request("paused", prompt, GREEDY)
    paused.add_request(req)
    for _ in PLAN:
        paused.step()
    paused_at = req.num_computed_tokens
    rebuild = 0
    while not req.spec_token_ids:
        paused.step()
        rebuild += 1
    assert len(req.spec_token_ids) == K and paused.snapshot().spec_plain_steps >= len(PLAN) - 3
    c = req.num_computed_tokens
    window = paused.model.cfg.sliding_window
    assert c - window - K >= paused_at  # no draft before a whole window was rewritten after the pause
    assert rebuild <= window + K + 1

    _assert_drafts_of_a_fresh_run(folder, paused, req)


def test_drafts_after_a_stretch_of_fewer_drafts_equal_those_of_a_fresh_run(
    mtp_checkpoint: Callable[[str], Path],
) -> None:
    """Load control may draft 1 for a while, then k again: the k drafts then (depth 2 and on included)
    equal those of a run that prefilled the same tokens and drafts k at once."""
    folder = mtp_checkpoint("mixed")
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    core = _core(folder)
    choices = chain([K], repeat(1, 6), repeat(K))
    core.spec.control.choose = lambda n, ready=None: next(choices)  # type: ignore[union-attr, method-assign]
    req = Request("varied", prompt, GREEDY)
    core.add_request(req)
    for _ in range(8):  # the last step drafts K after six steps drafting 1
        core.step()
    assert len(req.spec_token_ids) == K
    _assert_drafts_of_a_fresh_run(folder, core, req)


def _assert_drafts_of_a_fresh_run(folder: Path, core: EngineCore, req: Request) -> None:
    """``req``'s drafts and last window of MTP rows equal those of a run that takes its computed tokens as
    a prompt (its prefill writes every MTP row) and drafts at once."""
    c = req.num_computed_tokens
    fresh = _core(folder)
    ref = Request("fresh", req.all_token_ids[:c], GREEDY)
    fresh.add_request(ref)
    fresh.step()
    assert ref.output_token_ids[0] == req.all_token_ids[c]
    assert ref.spec_token_ids == req.spec_token_ids
    span = range(c - core.model.cfg.sliding_window, c)
    torch.testing.assert_close(_mtp_rows(core, req, span), _mtp_rows(fresh, ref, span), atol=1e-5, rtol=0)
