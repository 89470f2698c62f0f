"""Plain steps in a speculative engine: when load control picks no drafts, a step with nothing to verify
runs without the drafter and leaves the MTP window rows of its positions unwritten. Those rows must never
be read (by the request's later drafts, or by another request through the prefix cache), the tokens must
stay the non-speculative engine's, and drafting must resume once a whole window was written after them.

Every unwritten row is poisoned after each step: draft logits that read one would change. A run that
skips the readiness check (drafting right after the plain steps) shows that the poison is seen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request
from hybridserve.engine.sample.rejection_sampler import RejectionSampler
from hybridserve.engine.spec_decode.decoder import SpecDecoder
from tests.engine.spec_decode.spec_helpers import KV, POISON, mtp, spec_prompts

PLAIN_STEPS = range(5, 10)  # of every 40 engine steps, those load control runs plain (step 5 still
# verifies step 4's drafts); a wave of requests takes about 32 steps
CUTS = (5, 8, 11, 14, 27)  # second-wave prompts: a first-wave prompt and that many of its output tokens
PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

Drafted = list[tuple[str, int, torch.Tensor]]  # (request, position of the draft, its logits)


def _force_plain_steps(core: EngineCore) -> None:
    """Load control's choice by step: no drafts during PLAIN_STEPS, all k otherwise."""
    assert core.spec is not None
    control = core.spec.control

    def choose(num_running: int, num_ready: int | None = None) -> int:
        control.exploring = False
        return 0 if core.stats.steps % 40 in PLAIN_STEPS else control.k

    control.choose = choose  # type: ignore[method-assign]


def _poison_unwritten(core: EngineCore) -> None:
    """After each step, fill every unwritten MTP window row of a running request with a huge value."""
    assert core.spec is not None
    group, step = core.spec.draft_group, core.step
    pool = core.pools[group]
    per_block = pool.plan.rows_per_block

    def poisoned_step() -> list:
        outputs = step()
        for req in core.scheduler.running:
            if not core.coordinator.has_request(req.request_id):
                continue
            table = core.coordinator.block_tables(req.request_id)[group]
            a, b = core.coordinator.unwritten(req.request_id, group)
            slots = [
                block * per_block + pos % per_block
                for pos in range(a, min(b, len(table) * per_block))
                if (block := table[pos // per_block]) != NULL_BLOCK
            ]
            for t in pool.tensors.values() if slots else ():
                t.index_fill_(0, torch.tensor(slots, device=t.device), POISON)
        return outputs

    core.step = poisoned_step  # type: ignore[method-assign]


@contextmanager
def _recorded_drafts(log: Drafted) -> Iterator[None]:
    real = RejectionSampler.draft

    def draft(self: RejectionSampler, logits: torch.Tensor, requests: list[Request]) -> tuple:
        for row, req in zip(logits, requests, strict=True):
            log.append((req.request_id, req.num_tokens + len(req.spec_token_ids), row.clone()))
        return real(self, logits, requests)

    RejectionSampler.draft = draft  # type: ignore[method-assign]
    try:
        yield
    finally:
        RejectionSampler.draft = real  # type: ignore[method-assign]


def _llm(folder: Path, speculative: bool = True, **kwargs: int) -> LLM:
    """A small eager engine; speculative: MTP with k = 2, adaptive (the default config)."""
    spec = {"speculative_config": mtp(2, adaptive=True)} if speculative else {}
    return LLM(
        str(folder), block_tokens=8, kv_cache_memory=KV, max_num_seqs=4, enforce_eager=True, **spec, **kwargs
    )


def _run(folder: Path, prompts: list[list[int]], poison: bool) -> tuple[list[list[int]], Drafted, LLM]:
    """Two waves: the prompts, then each prompt with a part of its output (prefix hits on the first wave's
    blocks, near and past the window rows the plain steps left unwritten)."""
    llm = _llm(folder, max_num_batched_tokens=64)
    _force_plain_steps(llm.engine)
    if poison:
        _poison_unwritten(llm.engine)
    log: Drafted = []
    with _recorded_drafts(log):
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
        again = _second_wave(prompts, first)
        second = [o.outputs[0].token_ids for o in llm.generate(again, PARAMS)]
    return first + second, log, llm


def _second_wave(prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    return [p + o[:cut] for p, o in zip(prompts, outputs, strict=True) for cut in CUTS]


def _same_drafts(a: Drafted, b: Drafted) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [p for p in spec_prompts(8, seed=11) if len(p) >= 6][:3]


def test_unwritten_window_rows_are_never_read_and_drafting_resumes(
    mtp_checkpoint: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    folder = mtp_checkpoint("mixed")
    plain_llm = _llm(folder, speculative=False)
    first = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, PARAMS)]
    again = _second_wave(prompts, first)
    expected = first + [o.outputs[0].token_ids for o in plain_llm.generate(again, PARAMS)]

    clean_tokens, clean, llm = _run(folder, prompts, poison=False)
    poisoned_tokens, poisoned, _ = _run(folder, prompts, poison=True)
    assert clean_tokens == poisoned_tokens == expected
    assert _same_drafts(clean, poisoned)

    snap = llm.engine.snapshot()
    assert snap.spec_plain_steps >= 2 * (len(PLAIN_STEPS) - 1)  # both waves
    # every second-wave prompt resumes from its last whole block: the trunk's blocks serve it, and the
    # MTP window's rows the plain steps left unwritten start unwritten (rewritten before it drafts)
    block = llm.engine.coordinator.block_tokens
    assert snap.prefix_hit_tokens == sum((len(p) - 1) // block * block for p in again)
    window = (llm.engine.spec.window_tokens or 0) if llm.engine.spec is not None else 0
    resumed = {rid for rid, pos, _ in clean if pos > len(prompts[0]) + len(PLAIN_STEPS) + window}
    assert resumed, "drafting never resumed after the plain steps"
    llm.engine.pools.check_integrity()
    llm.engine.reset_prefix_cache()
    assert llm.engine.pools.all_free()


def test_the_poison_is_seen_when_drafting_does_not_wait(
    mtp_checkpoint: Callable[[str], Path], prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: drafting straight after the plain steps reads the unwritten rows."""
    folder = mtp_checkpoint("mixed")
    monkeypatch.setattr(SpecDecoder, "window_ready", lambda self, req: True)
    _, clean, _ = _run(folder, prompts, poison=False)
    _, poisoned, _ = _run(folder, prompts, poison=True)
    assert not _same_drafts(clean, poisoned)


def test_load_control_times_both_kinds_of_step_on_real_steps(
    mtp_checkpoint: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """Unforced, the controller tries drafting and a plain step, learns the parts of each from the
    engine's own steps, and the tokens stay the plain engine's."""
    folder = mtp_checkpoint("mixed")
    expected = [o.outputs[0].token_ids for o in _llm(folder, speculative=False).generate(prompts, PARAMS)]
    llm = _llm(folder)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    assert llm.engine.spec is not None
    control = llm.engine.spec.control
    assert control.draft_seconds and {plain for plain, _ in control.other_seconds} == {True, False}
    assert llm.engine.snapshot().spec_plain_steps > 0


def test_a_drafter_that_sees_every_row_never_drafts_after_a_plain_step(
    mtp_checkpoint: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """A draft group of the history kind (no window) would read the unwritten rows at every later draft."""
    folder = mtp_checkpoint("mixed")
    expected = [o.outputs[0].token_ids for o in _llm(folder, speculative=False).generate(prompts, PARAMS)]
    llm = _llm(folder)
    core = llm.engine
    assert core.spec is not None
    _force_plain_steps(core)
    core.spec.window_tokens = None
    steps_at_drafts: list[int] = []
    real = core.spec._sample_drafts

    def sample(*args: object) -> None:
        steps_at_drafts.append(core.stats.steps)
        real(*args)  # type: ignore[arg-type]

    core.spec._sample_drafts = sample  # type: ignore[method-assign]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
    assert steps_at_drafts and max(steps_at_drafts) < PLAIN_STEPS.start
