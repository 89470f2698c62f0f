"""Prefill and mixed steps through one dynamically shaped compiled graph (PrefillGraphRunner) against the
eager engine, on CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.engine.worker import prefill_graphs
from tests.engine.worker.prefill_graph_helpers import (  # noqa: F401  (fresh_dynamo: an autouse fixture)
    PARAMS,
    assert_close,
    fresh_dynamo,
    graph_llm,
    graph_prompts,
    null_rows_zero,
    prefill_runner,
)

pytestmark = pytest.mark.slow_file(seconds=125)  # scheduled first: never the run's tail


@pytest.mark.parametrize("name", ["mixed", "csa_heavy", "yarn"])
def test_compiled_prefill_matches_eager(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path], name: str
) -> None:
    """Chunked prompts of 6-40 tokens beside decoding requests, traced by dynamo (its "eager" backend: the
    graph, guards and specialisations without inductor's CI minutes): after the warm-up's dummy steps no
    graph compiles, every step of 2+ requests runs the one graph, and the outputs are the eager engine's.
    ``yarn`` has one hyper-connection stream and CSA at rate 2."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    prompts = graph_prompts((6, 19, 33, 11, 25, 40))
    plain = graph_llm(tiny_checkpoint(name), compiled=False).generate(prompts, PARAMS, use_tqdm=False)
    llm = graph_llm(tiny_checkpoint(name), compiled=True)
    runner = prefill_runner(llm)  # LLM(...) warmed it up, and the eager steps' mHC tail too
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "compiled mid-run"
    assert_close(plain, compiled)
    assert runner.steps["compiled"] >= 10
    pools = llm.engine.pools
    pools.check_integrity()
    assert pools.all_free() and null_rows_zero(pools)


def test_warmup_runs_dummy_steps_only(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Start-up warm-up writes only into the null block, which is zero again after; nothing is allocated,
    and its steps are not counted as served ones. Each engine's graph counts against its own recompile
    limit (one graph: steps with and without decodes share it), not against one shared by every engine in
    the process."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    for _ in range(2):
        with torch._dynamo.config.patch(recompile_limit=1):
            llm = graph_llm(tiny_checkpoint("mixed"), compiled=True)  # LLM(...) warms its graphs up
        runner = prefill_runner(llm)
        assert runner.compile_seconds > 0 and runner.warmed and runner.enabled
        pools = llm.engine.pools
        assert pools.all_free() and null_rows_zero(pools)
        assert runner.steps == {"compiled": 0, "eager": 0}


def test_lone_short_chunks_run_the_graph_and_refused_steps_run_eagerly(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """A lone request: its 21-token prompt runs the graph (its one block-table row padded to two), and so
    does a lone 2-token prompt (one query block and one completed window of each branch, each padded to
    two: a dim of 1 is a size the graph never takes). A step whose metadata the graph's guards refuse
    (here: query blocks of 1, which have no padded-row index) runs eagerly on that same metadata instead of
    compiling; one-token steps take the plain eager path. The outputs stay the eager engine's."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    plain = graph_llm(tiny_checkpoint("mixed"), compiled=False)  # first: an engine sets the global mHC switch
    llm = graph_llm(tiny_checkpoint("mixed"), compiled=True)
    runner = prefill_runner(llm)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    paths = llm.engine.runner.steps_by_path  # what /metrics reports
    cases = (
        (21, "compiled", "prefill_graph"),
        (2, "compiled", "prefill_graph"),
        (2, "eager", "prefill_graph_refused"),
    )
    for n, kind, path in cases:
        if kind == "eager":
            monkeypatch.setattr(prefill_graphs, "BLOCK_SIZES", (1,))
        before, paths_before = dict(runner.steps), dict(paths)
        prompts = graph_prompts((n,))
        assert_close(
            plain.generate(prompts, PARAMS, use_tqdm=False), llm.generate(prompts, PARAMS, use_tqdm=False)
        )
        assert runner.steps[kind] == before[kind] + 1, (n, runner.steps)
        assert sum(runner.steps.values()) == sum(before.values()) + 1
        assert paths[path] == paths_before.get(path, 0) + 1
        assert paths["eager"] == paths_before.get("eager", 0) + PARAMS.max_tokens - 1  # one-token steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert null_rows_zero(llm.engine.pools)
