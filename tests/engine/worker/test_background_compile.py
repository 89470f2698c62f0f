"""Compiling in the background (the server's default): steps run eagerly until their graphs are ready,
each graph takes over once compiled, outputs stay the eager engine's, and the engine says when it reached
full speed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve.engine import llm as llm_module
from hybridserve.engine.llm import LLM
from hybridserve.engine.worker import decode_graphs, prefill_graphs
from hybridserve.engine.worker.graph_readiness import DECODE, PREFILL, TAIL, GraphReadiness
from tests.engine.worker.prefill_graph_helpers import (  # noqa: F401  (fresh_dynamo: an autouse fixture)
    PARAMS,
    assert_close,
    fresh_dynamo,
    graph_prompts,
    null_rows_zero,
)

pytestmark = pytest.mark.slow_file(seconds=60)  # scheduled first: never the run's tail

ENGINE = dict(block_tokens=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256)


def test_steps_run_eagerly_until_their_graphs_are_ready(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    folder = str(tiny_checkpoint("mixed"))
    prompts = graph_prompts((5, 30, 17, 41))
    plain = LLM(folder, enforce_eager=True, **ENGINE).generate(prompts, PARAMS, use_tqdm=False)
    monkeypatch.setattr(llm_module, "_warm_up", lambda engine, show: None)  # as the server: no waiting
    llm = LLM(folder, **ENGINE)  # compiled by default, over the arena
    runner = llm.engine.runner
    release = threading.Event()
    warm_part = runner._warm_part

    def held(name: str, warm: Callable[[], str | None]) -> None:
        assert release.wait(60), "the test never released the compile"
        warm_part(name, warm)

    monkeypatch.setattr(runner, "_warm_part", held)
    thread = runner.start_background_warmup()
    assert_close(plain, llm.generate(prompts, PARAMS, use_tqdm=False))
    assert set(runner.steps_by_path) == {"eager"}, "a step took a graph before it was compiled"
    assert llm.engine.snapshot().full_speed_s is None
    release.set()
    thread.join(timeout=600)
    assert not thread.is_alive()
    snapshot = llm.engine.snapshot()
    assert set(snapshot.compiled_ready_s) == {TAIL, DECODE, PREFILL} and snapshot.full_speed_s is not None
    assert_close(plain, llm.generate(prompts, PARAMS, use_tqdm=False))
    assert runner.steps_by_path["decode_graph"] >= PARAMS.max_tokens - 1
    assert runner.steps_by_path["prefill_graph"] >= 1
    assert null_rows_zero(llm.engine.pools) and llm.engine.pools.all_free()


def test_a_step_never_waits_for_a_compile() -> None:
    graphs = GraphReadiness()
    with graphs.use() as ready:  # before any background warm-up: every part (compiled on first use)
        assert DECODE in ready and PREFILL in ready
    graphs.start_gating()
    graphs.ready(DECODE)
    with graphs.use() as ready:
        assert DECODE in ready and PREFILL not in ready
    with graphs.compiling(), graphs.use() as ready:  # another thread compiles: no part, and no waiting
        assert DECODE not in ready
    graphs.ready(PREFILL)
    assert graphs.all_ready() >= graphs.ready_after[PREFILL] >= graphs.ready_after[DECODE]
    with graphs.compiling(), graphs.use() as ready:  # at full speed the lock is not taken
        assert PREFILL in ready
