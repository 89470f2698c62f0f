"""Prefill and mixed steps through one dynamically shaped compiled graph (PrefillGraphRunner) against the
eager engine, on CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridserve.cache.pool import BlockPoolSet
from hybridserve.config import EngineConfig
from hybridserve.engine import decode_graphs, prefill_graphs
from hybridserve.engine.llm import LLM
from hybridserve.engine.prefill_graphs import PrefillGraphRunner
from hybridserve.engine.request import RequestOutput, SamplingParams
from tests.tiny_models import VOCAB, TinySpec, make_checkpoint

# Compiled steps pick query blocks of 2 or more and pad compressed reads: other matmul groupings than the
# eager steps', so logprobs agree to float32 rounding, not bit for bit.
ATOL = 1e-4
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Every runner's graph is cached on the one code object of ``PrefillGraphRunner._forward``: earlier
    tests' entries would count against dynamo's recompile limit, past which it runs frames eagerly."""
    torch._dynamo.reset()


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _llm(checkpoint: Path, compiled: bool, **kwargs: int) -> LLM:
    """The offline engine, fixed cache layout, 48-token steps (chunked prompts beside decodes)."""
    common = dict(block_tokens=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256)
    if compiled:
        return LLM(str(checkpoint), compile_prefill=True, **{**common, **kwargs})
    return LLM(str(checkpoint), enforce_eager=True, cache_layout="fixed", **{**common, **kwargs})


def _null_rows_zero(pools: BlockPoolSet) -> bool:
    return not any(rows.any() for rows in pools.null_rows())


def _assert_close(plain: list[RequestOutput], compiled: list[RequestOutput]) -> None:
    """Same greedy tokens; sampled and prompt logprobs equal to float32 rounding."""
    for a, b in zip(plain, compiled, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = list(zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True))
        pairs += [(x, y) for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True) if x]
        assert pairs
        for x, y in pairs:
            assert y is not None and x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= ATOL for t in x)


def _runner(llm: LLM) -> PrefillGraphRunner:
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None
    return graphs


@pytest.mark.parametrize("name", ["mixed", "csa_heavy", "yarn"])
def test_compiled_prefill_matches_eager(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path], name: str
) -> None:
    """Chunked prompts of 6-40 tokens beside decoding requests, traced by dynamo (its "eager" backend: the
    graph, guards and specialisations without inductor's CI minutes): after the warm-up's dummy steps no
    graph compiles, every step of 2+ requests runs the one graph, and the outputs are the eager engine's.
    ``yarn`` has one hyper-connection stream and CSA at rate 2."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    prompts = _prompts((6, 19, 33, 11, 25, 40))
    plain = _llm(tiny_checkpoint(name), compiled=False).generate(prompts, PARAMS, use_tqdm=False)
    llm = _llm(tiny_checkpoint(name), compiled=True)
    runner = _runner(llm)
    llm.engine.warmup()  # the engine core warms up the eager steps' mHC tail too
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "compiled mid-run"
    _assert_close(plain, compiled)
    assert runner.steps["compiled"] >= 10
    pools = llm.engine.pools
    pools.check_integrity()
    assert pools.all_free() and _null_rows_zero(pools)


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
    the prefill graph, every pure decode step a decode graph, and the outputs are the eager engine's."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    folder = str(make_checkpoint(ODD_SIZES, tmp_path / "odd"))
    common = dict(block_tokens=32, max_num_seqs=12, max_num_batched_tokens=96, max_model_len=256)
    prompts = _prompts((1, 2, 7, 19, 33, 50, 64, 3, 90, 120, 70))
    plain = LLM(folder, enforce_eager=True, cache_layout="fixed", **common).generate(
        prompts, PARAMS, use_tqdm=False
    )
    llm = LLM(folder, compile_decode=True, compile_prefill=True, **common)
    _assert_close(plain, llm.generate(prompts, PARAMS, use_tqdm=False))
    paths = llm.engine.runner.steps_by_path
    assert paths["prefill_graph"] >= 4 and paths["decode_graph"] >= PARAMS.max_tokens - 1
    assert paths["prefill_graph_refused"] == 0
    assert _null_rows_zero(llm.engine.pools) and llm.engine.pools.all_free()


def test_warmup_runs_dummy_steps_only(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Start-up warm-up writes only into the null block, which is zero again after; nothing is allocated,
    and its steps are not counted as served ones. Each engine's graph counts against its own recompile
    limit (two graphs here: plain steps and mixed ones that read their decodes apart), not against one
    shared by every engine in the process."""
    monkeypatch.setattr(prefill_graphs, "GRAPH_BACKEND", "eager")
    for _ in range(2):
        llm = _llm(tiny_checkpoint("mixed"), compiled=True)
        runner = _runner(llm)
        with torch._dynamo.config.patch(recompile_limit=2):
            assert runner.warmup() > 0 and runner.warmed and runner.enabled
        pools = llm.engine.pools
        assert pools.all_free() and _null_rows_zero(pools)
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
    plain = _llm(tiny_checkpoint("mixed"), compiled=False)  # first: an engine sets the global mHC switch
    llm = _llm(tiny_checkpoint("mixed"), compiled=True)
    runner = _runner(llm)
    llm.engine.warmup()
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
        prompts = _prompts((n,))
        _assert_close(
            plain.generate(prompts, PARAMS, use_tqdm=False), llm.generate(prompts, PARAMS, use_tqdm=False)
        )
        assert runner.steps[kind] == before[kind] + 1, (n, runner.steps)
        assert sum(runner.steps.values()) == sum(before.values()) + 1
        assert paths[path] == paths_before.get(path, 0) + 1
        assert paths["eager"] == paths_before.get("eager", 0) + PARAMS.max_tokens - 1  # one-token steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert _null_rows_zero(llm.engine.pools)


def test_inductor_compiled_prefill_matches_eager(tiny_checkpoint: Callable[[str], Path]) -> None:
    """The real backend (inductor's C++ code on CPU), warmed up by the first prefill step; on the 2-layer
    model (a CI minute)."""
    prompts = _prompts((17, 30, 9))
    plain = _llm(tiny_checkpoint("yarn"), compiled=False).generate(prompts, PARAMS, use_tqdm=False)
    llm = _llm(tiny_checkpoint("yarn"), compiled=True)
    compiled = llm.generate(prompts, PARAMS, use_tqdm=False)
    runner = _runner(llm)
    assert runner.enabled and runner.warmed and runner.compile_seconds > 0
    assert runner.steps["compiled"] >= 4
    _assert_close(plain, compiled)


def test_compile_prefill_takes_the_fixed_layout() -> None:
    """Like --compile-decode: the fixed split by default, and the arena refused with the reason."""
    assert EngineConfig(compile_prefill=True).resolved_cache_layout == "fixed"
    with pytest.raises(ValueError, match="--compile-prefill needs --cache-layout fixed"):
        EngineConfig(compile_prefill=True, cache_layout="arena")
