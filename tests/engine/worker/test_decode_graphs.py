"""Bucketed, static-shaped decode steps (DecodeGraphRunner) against the plain eager path, on CPU."""

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
from hybridserve.engine.llm import LLM
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.worker import decode_graphs
from hybridserve.engine.worker.batch import build_forward_batch
from hybridserve.engine.worker.compile_policy import CompilePolicy
from hybridserve.engine.worker.decode_graphs import DecodeGraphRunner, batch_buckets, row_bucket
from hybridserve.engine.worker.model_runner import ModelRunner
from hybridserve.layers import moe
from hybridserve.models.deepseek_v4 import DeepseekV4Model
from hybridserve.models.loader import load_model
from tests.tiny_models import VOCAB, TinySpec, make_checkpoint

pytestmark = pytest.mark.slow_file(seconds=90)  # scheduled first: never the run's tail

CHUNK, DECODE_STEPS, MAX_LEN = 7, 30, 256
# Real rows of a padded bucket differ from the unpadded batch by fp32 rounding only: other GEMM row counts
# (dummy rows) and longer masked reductions (padded N) regroup sums. Measured <= 1.2e-5 on logits of
# magnitude <= 4.7 (about 25 ulp); without padding (exact buckets and N) the static path is bit-identical.
ATOL = 1e-4


def _null_rows_zero(pools: BlockPoolSet) -> bool:
    for pool in pools.pools.values():
        rows = pool.plan.rows_per_block
        for t in pool.tensors.values():
            if t[NULL_BLOCK * rows : (NULL_BLOCK + 1) * rows].any():
                return False
    return True


def _cache(model: DeepseekV4Model, num_blocks: int) -> tuple[BlockPoolSet, KvCacheCoordinator]:
    """Fixed pools of ``num_blocks`` blocks per group (8-token blocks), their coordinator, no prefix cache."""
    plan = build_plan(model.cache_specs(), 8, 8, 512, num_blocks=num_blocks)
    pools = BlockPoolSet(plan, "cpu")
    return pools, KvCacheCoordinator(plan, pools, enable_prefix_caching=False)


def _run(
    model: DeepseekV4Model,
    prompts: tuple[int, ...],
    graphs: bool,
    exact: bool = False,
    compiled: bool = False,
    warm: bool = False,
    direct: bool = True,
) -> tuple[list[torch.Tensor], BlockPoolSet]:
    """Chunked prefill on the plain path, then greedy decode on the plain or the bucketed path; ``warm``:
    the runner's start-up warm-up first, after which no new graph may compile; ``direct``: a compiled
    runner's batch-4 key must come to call its graph directly."""
    pools, coord = _cache(model, 128)
    sizes = list(range(1, 9)) if exact else None
    runner = DecodeGraphRunner(
        model,
        pools,
        coord,
        torch.device("cpu"),
        8,
        MAX_LEN,
        batch_sizes=sizes,
        pad_rows=not exact,
        compiled=compiled,
    )
    if warm:
        runner.warmup()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(f"r{i}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), SamplingParams())
        for i, n in enumerate(prompts)
    ]
    logits = []
    for _ in range(-(-max(prompts) // CHUNK) + DECODE_STEPS):
        step = [
            ScheduledRequest(r, r.num_computed_tokens, min(CHUNK, r.num_tokens - r.num_computed_tokens))
            for r in reqs
        ]
        for s in step:
            assert coord.allocate(s.request.request_id, s.start, s.end)
        if graphs and runner.supports(step):
            out = runner.run(step)
            assert _null_rows_zero(pools)
        else:
            batch = build_forward_batch(step, coord, torch.device("cpu"))
            out = model.compute_logits(model(batch, pools.tensors())[batch.logits_indices])
        sampling = [s.request for s in step if s.samples]
        if len(sampling) == len(step):
            logits.append(out)
        for s in step:
            s.request.num_computed_tokens = s.end
        for r, row in zip(sampling, out, strict=True):
            r.output_token_ids.append(int(row.argmax()))
    pools.check_integrity()
    if warm:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before, "compiled mid-run"
    if compiled and direct:  # the decode steps' key (batch 4) soon called its graph without dynamo
        assert any(e.direct is not None for key, e in runner.entries.items() if key[0] == 4)
    return logits, pools


def _assert_matches(plain: list[torch.Tensor], other: list[torch.Tensor], pools: BlockPoolSet) -> None:
    """Logits equal to rounding (ATOL) and the same greedy tokens at every step; null blocks zero."""
    assert len(plain) == len(other) >= DECODE_STEPS
    worst = max(float((a - b).abs().max()) for a, b in zip(plain, other, strict=True))
    assert worst <= ATOL
    for a, b in zip(plain, other, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert _null_rows_zero(pools)


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert [row_bucket(n, 64) for n in (0, 1, 16, 17, 40, 64)] == [16, 16, 16, 32, 64, 64]
    assert row_bucket(10, 4) == 10  # never below the real count


@pytest.mark.parametrize("name", ["mixed", "csa_heavy"])
@pytest.mark.parametrize("prompts", [(23, 9, 40), (5, 17, 30, 12, 3)])
def test_bucketed_decode_matches_eager(
    name: str, prompts: tuple[int, ...], tiny_checkpoint: Callable[[str], Path]
) -> None:
    model = load_model(tiny_checkpoint(name), torch.float32, "cpu")
    plain, _ = _run(model, prompts, graphs=False)
    padded, pools = _run(model, prompts, graphs=True)
    _assert_matches(plain, padded, pools)


def test_padded_batch_dummies(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Dummies: position 0, all-null tables; their writes are undone; static buffers are reused."""
    model = load_model(tiny_checkpoint("mixed"), torch.float32, "cpu")
    pools, coord = _cache(model, 64)
    runner = DecodeGraphRunner(model, pools, coord, torch.device("cpu"), 8, MAX_LEN)
    reqs = [Request(f"r{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in enumerate((10, 20, 5))]
    for r in reqs:
        assert coord.allocate(r.request_id, 0, r.num_tokens)
        step = [ScheduledRequest(r, 0, r.num_tokens)]
        model(build_forward_batch(step, coord, torch.device("cpu")), pools.tensors())
        r.num_computed_tokens = r.num_tokens - 1
    decode = [ScheduledRequest(r, r.num_tokens - 1, 1) for r in reqs]
    first = runner.run(decode)
    assert first.shape[0] == 3 and len(runner.entries) == 1
    entry = next(iter(runner.entries.values()))
    assert entry.batch.num_tokens == 4 and entry.batch.positions[3] == 0
    assert all(not t[3].any() for t in entry.batch.block_tables.values())
    buffers = [t.data_ptr() for t in (entry.batch.input_ids, *entry.batch.block_tables.values())]
    second = runner.run(decode)  # same inputs, same slots rewritten: same logits, same buffers
    assert torch.equal(first, second) and len(runner.entries) == 1
    assert buffers == [t.data_ptr() for t in (entry.batch.input_ids, *entry.batch.block_tables.values())]
    assert _null_rows_zero(pools)
    pools.check_integrity()


def _several_tokens_a_row(model: DeepseekV4Model, graphs: bool) -> list[torch.Tensor]:
    """Three prompts computed 1-3 tokens per request a step (as a speculative engine's verify steps), on
    the plain path or through a decode runner that takes 3 tokens a request -> every token's logits."""
    pools, coord = _cache(model, 128)
    runner = DecodeGraphRunner(model, pools, coord, torch.device("cpu"), 8, MAX_LEN, tokens_per_request=3)
    g = torch.Generator().manual_seed(1)
    lengths = (70, 45, 90)
    reqs = [
        Request(f"r{i}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), SamplingParams())
        for i, n in enumerate(lengths)
    ]
    logits = []
    for step_no in range(max(lengths)):
        left = [(i, r, r.num_tokens - r.num_computed_tokens) for i, r in enumerate(reqs)]
        step = [
            ScheduledRequest(r, r.num_computed_tokens, min(n, 1 + (step_no + i) % 3)) for i, r, n in left if n
        ]
        if not step:
            break
        for s in step:
            assert coord.allocate(s.request.request_id, s.start, s.end)
        if graphs:
            assert runner.supports(step)
            logits.append(runner.run(step).clone())
        else:
            logits.append(
                model.compute_logits(
                    model(build_forward_batch(step, coord, torch.device("cpu")), pools.tensors())
                )
            )
        for s in step:
            s.request.num_computed_tokens = s.end
    pools.check_integrity()
    assert _null_rows_zero(pools)
    return logits


@pytest.mark.parametrize("name", ["mixed", "csa_heavy"])
def test_rows_of_several_tokens_a_request_match_eager(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """A row per token, a request's rows at consecutive positions with its table: every token's logits
    equal the plain path's (to ATOL), so a later row sees the window KV, compressor inputs and compressed
    rows (CSA's indexer keys included) its request's earlier rows wrote in the same step."""
    model = load_model(tiny_checkpoint(name), torch.float32, "cpu")
    plain, rows = _several_tokens_a_row(model, False), _several_tokens_a_row(model, True)
    assert len(plain) == len(rows) >= 45
    for a, b in zip(plain, rows, strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) <= ATOL
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("name", ["mixed", "csa_heavy"])
def test_static_buffers_without_padding_are_bit_identical(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model = load_model(tiny_checkpoint(name), torch.float32, "cpu")
    plain, _ = _run(model, (5, 17, 30, 12, 3), graphs=False)
    static, pools = _run(model, (5, 17, 30, 12, 3), graphs=True, exact=True)
    for a, b in zip(plain, static, strict=True):
        assert torch.equal(a, b)
    assert _null_rows_zero(pools)


def _llm(checkpoint: Path, graphs: bool, **kwargs: int) -> LLM:
    """The offline engine on ``checkpoint``, with decode graphs or not (their eager static path)."""
    llm = LLM(str(checkpoint), block_tokens=8, max_num_seqs=8, **kwargs, enforce_eager=True)
    core = llm.engine
    core.runner = ModelRunner(
        core.model,
        core.pools,
        core.coordinator,
        core.runner.sampler,
        core.device,
        CompilePolicy(decode_graphs=graphs, compile_decode=False, compile_prefill=False, compile_tail=False),
        max_num_seqs=8,
        max_model_len=MAX_LEN,
    )
    return llm


@pytest.mark.parametrize("name", ["mixed", "csa_heavy"])
def test_engine_greedy_tokens_equal(name: str, tiny_checkpoint: Callable[[str], Path]) -> None:
    """Through the engine: a runner of decode graphs generates the plain runner's greedy tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 19, 33, 11, 25)]
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
    outputs = []
    for graphs in (False, True):
        llm = _llm(tiny_checkpoint(name), graphs)
        core = llm.engine
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        core.pools.check_integrity()
        if graphs:
            assert core.runner.decode_graphs is not None and core.runner.decode_graphs.entries
            assert _null_rows_zero(core.pools)
    assert outputs[0] == outputs[1]
    assert all(len(t) == DECODE_STEPS for t in outputs[0])


def test_one_token_prompt_chunks_keep_their_prompt_logprobs(tiny_checkpoint: Callable[[str], Path]) -> None:
    """A step of one-token rows is not a decode step when a row's prompt chunk gathers prompt logprobs
    (the static step computes none): with a 1-token budget every prompt token is such a step."""
    prompt = list(range(3, 12))
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    outs = [
        _llm(tiny_checkpoint("mixed"), graphs, max_num_batched_tokens=1).generate([prompt], params)[0]
        for graphs in (False, True)
    ]
    plain, static = (o.prompt_logprobs for o in outs)
    assert plain is not None and static is not None and len(plain) == len(static) == len(prompt)
    for a, b in zip(plain[1:], static[1:], strict=True):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.parametrize(
    ("all_experts_rows", "backend", "graphs"),
    [(256, "inductor", 2), (8, "eager", 3)],
    ids=["all-experts-inductor", "grouped-eager"],
)
def test_compiled_decode_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[[str], Path],
    all_experts_rows: int,
    backend: str,
    graphs: int,
) -> None:
    """torch.compile (inductor's C++ backend on CPU) of the static step: fp32 rounding, same tokens. The
    start-up warm-up compiles the graphs (batch 1, and batch 2 with the batch dim dynamic; the 4 experts
    run all at once up to 64 tokens, or here up to 2, when batch 8 compiles the grouped side of that guard:
    traced by dynamo alone, as inductor would take a CI minute more); then three requests decode padded to
    batch 4 while their CSA rows grow from 1-3 to 9, across two row buckets (4 -> 8 -> 16), and no graph
    compiles: serving never stops to compile a batch size or a longer context. A second runner (a restart)
    loads inductor's graphs from the folder the first saved them in, traces none, and gives the same bits.
    Buckets from 2 rows up make the shortest CSA bucket the indexer's top-k (2) unless the runner pads
    past it, which once specialised the graph to keeping every row."""
    monkeypatch.setattr(decode_graphs, "MIN_ROW_BUCKET", 2)
    monkeypatch.setattr(moe, "ALL_EXPERTS_MAX_ROWS", all_experts_rows)
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", backend)
    model = load_model(tiny_checkpoint("csa_heavy"), torch.float32, "cpu")
    plain, _ = _run(model, (9, 5, 7), graphs=False)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, pools = _run(model, (9, 5, 7), graphs=True, compiled=True, warm=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == graphs
    _assert_matches(plain, compiled, pools)
    if backend == "inductor":  # a restart: the graphs saved with their guards load, none is traced
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        loaded, pools = _run(model, (9, 5, 7), graphs=True, compiled=True, warm=True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
        assert all(torch.equal(a, b) for a, b in zip(compiled, loaded, strict=True))
        _assert_matches(plain, loaded, pools)


# One CSA layer: a model whose graphs trace in a third of the time of the three-layer ones.
ONE_LAYER = TinySpec("one_layer", 5, ("compressed_sparse_attention",), ("moe",), csa_rate=4, index_topk=2)


def test_each_runner_has_its_own_recompile_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every runner compiles the one function ``DecodeGraphRunner._logits``: with the graphs of all
    runners counted against one recompile limit, the ninth compiled engine in a process ran its first steps
    eagerly and then failed every request. With dynamo's limit at what one runner compiles (3 graphs), a
    second runner still compiles all of its own."""
    monkeypatch.setattr(decode_graphs, "MIN_ROW_BUCKET", 2)
    monkeypatch.setattr(moe, "ALL_EXPERTS_MAX_ROWS", 8)
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    model = load_model(make_checkpoint(ONE_LAYER, tmp_path / "one_layer"), torch.float32, "cpu")
    plain, _ = _run(model, (9, 5, 7), graphs=False)
    torch._dynamo.reset()
    for _ in range(2):
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(recompile_limit=3):
            compiled, pools = _run(model, (9, 5, 7), graphs=True, compiled=True, warm=True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 3
        _assert_matches(plain, compiled, pools)


def test_a_step_dynamo_runs_as_is_stays_eager(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Where dynamo compiles no graph for a key's first run (past its recompile limit it runs the frame as
    is), that key's later steps run eagerly too, not through dynamo with guards skipped, which raises."""
    monkeypatch.setattr(decode_graphs, "GRAPH_BACKEND", "eager")
    model = load_model(tiny_checkpoint("csa_heavy"), torch.float32, "cpu")
    plain, _ = _run(model, (9, 5, 7), graphs=False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=0):
        eager, pools = _run(model, (9, 5, 7), graphs=True, compiled=True, direct=False)
    _assert_matches(plain, eager, pools)


def test_warmup_runs_dummy_steps_only(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Start-up warm-up: batch 1, 2 and the largest bucket (8), of dummies only; nothing allocated, the null
    blocks zero again."""
    model = load_model(tiny_checkpoint("mixed"), torch.float32, "cpu")
    pools, coord = _cache(model, 32)
    runner = DecodeGraphRunner(model, pools, coord, torch.device("cpu"), 8, MAX_LEN)
    assert runner.warmup() >= 0
    assert sorted(key[0] for key in runner.entries) == [1, 2, 8]
    assert all(entry.ran for entry in runner.entries.values())
    assert _null_rows_zero(pools) and pools.all_free()
