"""Routed experts (grouped, gathered-weight and dense paths) against a direct per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.layers import moe
from hybridserve.layers.moe import Experts, clamped_swiglu

LIMIT = 2.0  # gate and up values have a std of about 2: the clamps bite
HIDDEN, INTER = 32, 16
PATHS = ["_grouped", "_gathered", "_dense"]
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 1.6e-2)}  # (atol, rtol)


def make_experts(n_experts: int, dtype: torch.dtype, hidden: int = HIDDEN, inter: int = INTER) -> Experts:
    experts = Experts(n_experts, hidden, inter, LIMIT)
    g = torch.Generator().manual_seed(n_experts)
    with torch.no_grad():
        for p in (experts.gate_up, experts.down):
            p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[-1] ** 0.5)
    return experts.to(dtype)


def hash_routed(
    n_tokens: int, top_k: int, n_experts: int, dtype: torch.dtype, hidden: int = HIDDEN, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weights, indices from a tid2eid-like table over 5 token ids: tokens repeat, and a row may repeat
    an expert."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, n_experts, (5, top_k), generator=g)
    indices = table[torch.randint(0, 5, (n_tokens,), generator=g)]
    weights = torch.rand(n_tokens, top_k, generator=g).to(dtype)
    return torch.randn(n_tokens, hidden, generator=g).to(dtype), weights, indices


def per_token_reference(
    experts: Experts, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Token by token, its k experts in ascending id order (ties by slot), summed one by one."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in sorted(range(idx.shape[1]), key=lambda j: (int(idx[t, j]), j)):
            e = int(idx[t, j])
            gate, up = F.linear(x[t], experts.gate_up[e]).chunk(2)
            acc = acc + (F.linear(clamped_swiglu(gate, up, LIMIT), experts.down[e]) * w[t, j]).to(x.dtype)
        rows.append(acc)
    return torch.stack(rows)


def per_expert_loop(experts: Experts, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The former implementation (transformers' too): per expert, one matmul over its tokens."""
    out = torch.zeros_like(x)
    for e in range(experts.gate_up.shape[0]):
        tokens, slots = torch.where(idx == e)
        gate, up = F.linear(x[tokens], experts.gate_up[e]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, LIMIT), experts.down[e]) * w[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def force(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setattr(Experts, "_expert_outputs", getattr(Experts, path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_experts", [4, 8, 64])
@pytest.mark.parametrize("top_k", [1, 2, 6])
@pytest.mark.parametrize("n_tokens", [1, 3, 16, 100])
@pytest.mark.parametrize("path", PATHS)
def test_matches_per_token_reference(
    monkeypatch: pytest.MonkeyPatch, path: str, n_tokens: int, top_k: int, n_experts: int, dtype: torch.dtype
) -> None:
    force(monkeypatch, path)
    experts = make_experts(n_experts, dtype)
    x, w, idx = hash_routed(n_tokens, top_k, n_experts, dtype, seed=n_tokens * top_k)
    with torch.no_grad():
        got = experts(x, w, idx)
        expected = per_token_reference(experts, x, w, idx)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("n_tokens", [0, 1, 3, 16, 100])
def test_grouped_bf16_repeats_the_per_expert_loop_bit_for_bit(n_tokens: int) -> None:
    """Each expert's rows go through the same matmul as in a loop over experts, so with distinct experts
    per token (top-k routing, real hash tables) bf16 results are identical; the bf16 model tests compare
    with transformers' loop at tolerance 0. (fp32 may differ by an ulp: SiLU's vector tail rounds apart.)"""
    experts = make_experts(8, torch.bfloat16, hidden=192, inter=160)
    g = torch.Generator().manual_seed(n_tokens)
    idx = torch.rand(n_tokens, 8, generator=g).argsort(dim=-1)[:, :6]
    x = torch.randn(n_tokens, 192, generator=g).bfloat16()
    w = torch.rand(n_tokens, 6, generator=g).bfloat16()
    assert moe._grouped_mm_is_async(x, experts.hidden, experts.inter)
    with torch.no_grad():
        assert torch.equal(experts(x, w, idx), per_expert_loop(experts, x, w, idx))


def rows_are_count_invariant(weight: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether this BLAS gives each row of ``rows @ weight.T`` the same bits whatever the row count."""
    whole = F.linear(rows, weight)
    return all(torch.equal(F.linear(rows[:n], weight), whole[:n]) for n in range(1, rows.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_output_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Chunked equals one-shot: bit for bit where the BLAS is row-count invariant (bf16 here), else to
    rounding (fp32 here: MKL treats 1-3 rows apart)."""
    experts = make_experts(8, dtype, hidden=192, inter=160)
    x, w, idx = hash_routed(40, 2, 8, dtype, hidden=192)
    with torch.no_grad():
        whole = experts(x, w, idx)
        chunked = torch.cat([experts(x[a:b], w[a:b], idx[a:b]) for a, b in [(0, 1), (1, 8), (8, 9), (9, 40)]])
        exact = rows_are_count_invariant(experts.gate_up[0], x) and rows_are_count_invariant(
            experts.down[0], torch.randn(40, 160).to(dtype)
        )
    if exact:
        assert torch.equal(chunked, whole)
    assert_close(chunked, whole, dtype)


@pytest.mark.parametrize(("n_tokens", "path"), [(1, "_gathered"), (16, "_dense")])
def test_unaligned_dims_fall_back_by_row_count(
    monkeypatch: pytest.MonkeyPatch, n_tokens: int, path: str
) -> None:
    """grouped_mm needs 16-byte rows; without them T*k < E rows take gathered weights, more take dense."""
    taken: list[str] = []
    original = getattr(Experts, path)

    def spy(self: Experts, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        taken.append(path)
        return original(self, x, experts)

    monkeypatch.setattr(Experts, path, spy)
    experts = make_experts(8, torch.float32, hidden=7, inter=5)
    x, w, idx = hash_routed(n_tokens, 2, 8, torch.float32, hidden=7)
    with torch.no_grad():
        got = experts(x, w, idx)
    assert taken == [path]
    assert_close(got, per_token_reference(experts, x, w, idx), torch.float32)


@pytest.mark.parametrize(
    ("path", "dtype"),
    [(None, torch.float32), (None, torch.bfloat16), ("_grouped", torch.bfloat16)]
    + [(p, torch.float32) for p in ("_gathered", "_dense")],
    ids=["auto-fp32", "auto-bf16", "grouped-bf16", "gathered-fp32", "dense-fp32"],
)
def test_forward_is_one_graph_without_host_syncs(
    monkeypatch: pytest.MonkeyPatch, path: str | None, dtype: torch.dtype
) -> None:
    """fullgraph=True fails on any .tolist()/.item(), data-dependent shape (bincount, nonzero) or branch."""
    if path:
        force(monkeypatch, path)
    torch._dynamo.reset()
    experts = make_experts(8, dtype)
    x, w, idx = hash_routed(16, 2, 8, dtype)
    with torch.no_grad():
        compiled = torch.compile(experts, fullgraph=True, backend="eager")
        assert_close(compiled(x, w, idx), experts(x, w, idx), dtype)


@pytest.mark.parametrize("n_tokens", [1, 16])
def test_compiled_cpu_experts_run_grouped_and_equal_eager_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, n_tokens: int
) -> None:
    """Under torch.compile on CPU fp32 the experts go through the opaque grouped_experts op (inductor
    would otherwise copy the picked experts' weights, or run every expert on every token), which runs
    the eager grouped path's own ops: the same bits."""
    monkeypatch.setattr(Experts, "_gathered", lambda *a: pytest.fail("gathered under compile"))
    monkeypatch.setattr(Experts, "_dense", lambda *a: pytest.fail("dense under compile"))
    torch._dynamo.reset()
    experts = make_experts(8, torch.float32, hidden=192, inter=160)
    x, w, idx = hash_routed(n_tokens, 2, 8, torch.float32, hidden=192)
    with torch.no_grad():
        eager = experts(x, w, idx)
        compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")(x, w, idx)
    assert torch.equal(compiled, eager)
    assert_close(eager, per_token_reference(experts, x, w, idx), torch.float32)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("n_tokens", [1, 5, 32])
def test_all_experts_form_matches_per_token_reference(
    monkeypatch: pytest.MonkeyPatch, n_tokens: int, top_k: int
) -> None:
    """Every expert on every token in two GEMMs, the unpicked ones weighted 0 (a hash table's repeated
    expert counted twice): equal to the per-token sum to float32 rounding, and under torch.compile the
    path a step of few tokens takes."""
    experts = make_experts(4, torch.float32)
    assert experts.prepare_all_experts(top_k=top_k)  # 4 experts: at most 4 x the needed flops
    x, w, idx = hash_routed(n_tokens, top_k, 4, torch.float32, seed=n_tokens)
    with torch.no_grad():
        expected = per_token_reference(experts, x, w, idx)
        assert_close(experts._all_experts_weighted(x, w, idx), expected, torch.float32)
        monkeypatch.setattr(Experts, "_expert_outputs", lambda *a: pytest.fail("per-expert under compile"))
        torch._dynamo.reset()
        compiled = torch.compile(experts, fullgraph=True, backend="eager")
        assert_close(compiled(x, w, idx), expected, torch.float32)


def test_all_experts_is_refused_where_it_would_waste(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many experts per pick, bf16 weights, or experts big enough that streaming every one costs more
    than the calls it saves: the flat copies would cost more than they save."""
    assert not make_experts(64, torch.float32).prepare_all_experts(top_k=2)
    assert not make_experts(4, torch.bfloat16).prepare_all_experts(top_k=2)
    experts = make_experts(4, torch.float32)
    monkeypatch.setattr(
        moe, "ALL_EXPERTS_MAX_BYTES", (experts.gate_up.numel() + experts.down.numel()) * 4 - 1
    )
    assert not experts.prepare_all_experts(top_k=2) and experts.all_experts is None
