"""The prefill graph with inductor's real C++ backend, and beside decode graphs on a model of odd sizes,
against the eager engine (as test_prefill_graphs.py). Apart from that file so that the test runner can give
these slow tests a worker of their own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.engine.worker import decode_graphs, prefill_graphs
from hybridserve.engine.worker.saved_graphs import SavedGraphs
from tests.engine.worker.prefill_graph_helpers import (  # noqa: F401  (fresh_dynamo: an autouse fixture)
    PARAMS,
    assert_close,
    fresh_dynamo,
    graph_llm,
    graph_prompts,
    null_rows_zero,
    prefill_runner,
)
from tests.tiny_models import TinySpec, make_checkpoint

pytestmark = pytest.mark.slow_file(seconds=140)  # scheduled first: never the run's tail

ODD_SIZES = TinySpec(  # 3 heads of 12, hidden 30 and experts of 10: rows not 16-byte aligned
    "odd_sizes",
    11,
    ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"),
    ("hash_moe", "moe", "moe"),
    extra=dict(
        hidden_size=30,
        moe_intermediate_size=10,
        num_attention_heads=3,
        head_dim=12,
        q_lora_rank=10,
        o_groups=3,
        o_lora_rank=6,
        index_head_dim=6,
    ),
)


def test_both_compiled_paths_on_odd_sizes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--compile-decode and --compile-prefill together on a model of odd sizes (no dim a multiple of 16),
    with 96-token steps: every prefill step of more tokens than the decode graphs' all-experts bound runs
    the prefill graph, every pure decode step a decode graph, and the outputs are the eager engine's. LLM(...)
    returns with its graphs compiled: no later generate call, batch 1 included, compiles anything."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    folder = str(make_checkpoint(ODD_SIZES, tmp_path / "odd"))
    common = dict(block_tokens=32, max_num_seqs=12, max_num_batched_tokens=96, max_model_len=256)
    prompts = graph_prompts((1, 2, 7, 19, 33, 50, 64, 3, 90, 120, 70))
    plain = LLM(folder, enforce_eager=True, cache_layout="fixed", **common).generate(
        prompts, PARAMS, use_tqdm=False
    )
    llm = LLM(folder, compile_decode=True, compile_prefill=True, **common)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert_close(plain, llm.generate(prompts, PARAMS, use_tqdm=False))
    assert_close(plain[:1], llm.generate(prompts[:1], PARAMS, use_tqdm=False))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a generate call compiled"
    paths = llm.engine.runner.steps_by_path
    assert paths["prefill_graph"] >= 4 and paths["decode_graph"] >= PARAMS.max_tokens - 1
    assert paths["prefill_graph_refused"] == 0
    assert null_rows_zero(llm.engine.pools) and llm.engine.pools.all_free()


def test_inductor_compiled_prefill_matches_eager(tiny_checkpoint: Callable[[str], Path]) -> None:
    """The real backend (inductor's C++ code on CPU), warmed up by the first prefill step, over the cache
    arena (the default layout: its rows reach the graph as ``FlatRows``); on the 2-layer model (a CI
    minute). Every step the graph supports runs it, short prompts included: its guards refuse none (they
    did while the trace kept Python floats as symbols). A second engine (a restart) loads the graph the
    first saved instead of tracing it."""
    prompts = graph_prompts((17, 30, 9))
    plain_llm = graph_llm(tiny_checkpoint("yarn"), compiled=False)
    plain = plain_llm.generate(prompts, PARAMS, use_tqdm=False)
    llm = graph_llm(tiny_checkpoint("yarn"), compiled=True, cache_layout="arena")
    assert llm.config.resolved_cache_layout == "arena"
    compiled = llm.generate(prompts, PARAMS, use_tqdm=False)
    runner = prefill_runner(llm)
    assert runner.enabled and runner.warmed and runner.compile_seconds > 0
    assert runner.steps["compiled"] >= 4 and runner.steps["eager"] == 0
    assert_close(plain, compiled)
    short = graph_prompts((7,))  # a step of 7 tokens alone
    expected = plain_llm.generate(short, PARAMS, use_tqdm=False)
    assert_close(expected, llm.generate(short, PARAMS, use_tqdm=False))
    assert runner.steps["eager"] == 0, "the graph's guards refused a step"
    restarted = graph_llm(tiny_checkpoint("yarn"), compiled=True, cache_layout="arena")
    saved = prefill_runner(restarted).compiled
    assert isinstance(saved, SavedGraphs) and (saved.loaded, saved.traced) == (1, 0), "a restart traced"
    assert_close(plain, restarted.generate(prompts, PARAMS, use_tqdm=False))
    assert prefill_runner(restarted).steps["eager"] == 0
