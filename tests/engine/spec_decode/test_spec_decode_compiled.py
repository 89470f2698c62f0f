"""Speculative decoding through compiled steps (--compile-decode, --compile-prefill): greedy output equals
transformers' batch-1 reference, with oracle drafts and poisoned rolled-back rows (as test_spec_decode.py).
Apart from that file so that the test runner can give these slow tests a worker of their own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve import LLM
from hybridserve.engine.core.engine_core import EngineCore
from tests.engine.spec_decode.spec_helpers import (
    GREEDY,
    KV,
    MAX_NEW,
    check_greedy,
    mtp,
    oracle_drafts,
    poison_after_steps,
    spec_prompts,
)
from tests.reference import reference_greedy

pytestmark = pytest.mark.slow_file(seconds=140)  # scheduled first: never the run's tail


def test_speculative_engine_builds_graphs_that_keep_streams(
    mtp_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --compile-decode a speculative engine's decode graphs take a request's 1 + k tokens (its verify
    steps) and keep each step's streams (its MTP layer reads them), and the MTP layer has draft graphs of
    its own; with --compile-prefill it has the prefill graph for longer chunks. (What the engines hold, not
    what they compile: their warm-up is skipped.)"""
    monkeypatch.setattr(EngineCore, "warmup", lambda self, progress=None: None)
    llm = LLM(
        str(mtp_checkpoint("mixed")),
        kv_cache_memory=KV,
        speculative_config=mtp(2),
        compile_decode=True,
        compile_prefill=True,
    )
    runner = llm.engine.runner
    assert runner.decode_graphs is not None and runner.decode_graphs.keep_streams
    assert runner.decode_graphs.tokens_per_request == 3
    assert runner.draft_graphs is not None and runner.draft_graphs.group_names == ["mtp_kv"]
    assert runner.prefill_graphs is not None
    plain = LLM(str(mtp_checkpoint("mixed")), kv_cache_memory=KV, compile_decode=True).engine.runner
    assert plain.decode_graphs is not None and not plain.decode_graphs.keep_streams
    assert plain.decode_graphs.tokens_per_request == 1 and plain.draft_graphs is None


# k = 1 with drafts off past 3 requests (decode graphs and the prefill graph in one run); k = 3 drafting
# throughout (accepted runs of every length up to 3)
@pytest.mark.parametrize(("k", "drafts_off_at"), [(1, 3), (3, None)])
def test_compiled_speculative_steps_equal_the_reference(
    tiny_checkpoint: Callable[[str], Path],
    mtp_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    k: int,
    drafts_off_at: int | None,
) -> None:
    """--compile-decode --compile-prefill with speculation: steps that verify drafts or none (here: while
    ``drafts_off_at`` requests run, vLLM's disable_by_batch_size) run through a decode graph (a row per
    token) that keeps its streams for the MTP layer, whose rows run through draft graphs; steps with longer
    prompt chunks through the prefill graph. All traced by dynamo's "eager" backend (as in
    test_prefill_graphs); oracle drafts are accepted in runs of every length, rolled-back rows are
    poisoned, and the greedy tokens are the batch-1 reference's."""
    from hybridserve.engine.worker import decode_graphs, prefill_graphs

    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    torch._dynamo.reset()
    base = tiny_checkpoint("mixed")
    prompts = spec_prompts(6, seed=5)
    expected = [reference_greedy(base, p, MAX_NEW) for p in prompts]
    # 4 at a time: with drafts off at 3, the first 4 requests verify none, the last 2 draft
    kwargs = dict(block_tokens=16, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=256)
    config = {**mtp(k), "disable_by_batch_size": drafts_off_at}
    with oracle_drafts({tuple(p): e for p, e in zip(prompts, expected, strict=True)}):
        llm = LLM(
            str(mtp_checkpoint("mixed")),
            kv_cache_memory=KV,
            speculative_config=config,
            compile_decode=True,
            compile_prefill=True,
            **kwargs,
        )
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        poison_after_steps(llm.engine)
        check_greedy(base, prompts, llm.generate(prompts, GREEDY), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "compiled mid-run"
    runner = llm.engine.runner
    assert runner.prefill_graphs is not None and runner.prefill_graphs.steps["compiled"] >= 1
    snap = llm.engine.snapshot()
    assert snap.steps_by_path["prefill_graph"] == runner.prefill_graphs.steps["compiled"]
    assert snap.steps_by_path.get("decode_graph", 0) >= MAX_NEW // (k + 1)  # verify steps included
    assert runner.drafts_by_path["graph"] > 0 and "eager" not in runner.drafts_by_path
    assert snap.spec_num_accepted_tokens > 0 and snap.spec_num_draft_tokens > snap.spec_num_accepted_tokens
    llm.engine.pools.check_integrity()
    llm.engine.reset_prefix_cache()
    assert llm.engine.pools.all_free()
