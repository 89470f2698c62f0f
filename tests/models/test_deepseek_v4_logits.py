"""Logits of the paged model against transformers, run one sequence at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.paged import PagedSequence
from tests.reference import chunked_logits, indexer_ties, reference_model, stable_indexer_topk
from tests.tiny_models import SPECS, VOCAB

TOL = {"float32": 2e-5, "bfloat16": 0.0}  # our bf16 path repeats the reference's roundings exactly
BLOCK = {"mixed": 8, "csa_heavy": 8, "yarn": 16, "bf16": 8}


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=sorted(SPECS))
def setup(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]
) -> tuple[str, PagedSequence, object]:
    name = request.param
    spec = SPECS[name]
    folder = tiny_checkpoint(name)
    dtype = getattr(torch, spec.dtype)
    return spec.dtype, PagedSequence(folder, dtype, BLOCK[name]), reference_model(folder, spec.dtype)


def assert_matches_reference(
    got: torch.Tensor, ref: object, ids: list[int], chunks: list[int], tol: float
) -> None:
    """Our logits equal the reference's for the same chunking; where they do not, the reference met an
    exact indexer top-k tie on that same chunked path and, with its tie order set to ours, equals us."""
    with indexer_ties(ref) as ties:
        expected = chunked_logits(ref, ids, chunks)
    assert got.dtype == expected.dtype
    if torch.allclose(got.float(), expected.float(), atol=tol, rtol=0):
        return
    assert ties, "logits differ and the reference met no indexer tie on this chunked path"
    with stable_indexer_topk():
        expected = chunked_logits(ref, ids, chunks)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("chunks", [[45], [7, 5, 13, 1, 1, 9, 4, 5], [1] * 45, [16, 16, 13]])
def test_prefill_logits_match_reference_for_any_chunking(setup: tuple, chunks: list[int]) -> None:
    dtype, ours, ref = setup
    ids = _prompt(sum(chunks), seed=len(chunks))
    got = ours.logits(ids, chunks)
    assert_matches_reference(got, ref, ids, chunks, TOL[dtype])


def test_decode_steps_match_reference(setup: tuple) -> None:
    dtype, ours, ref = setup
    ids = _prompt(23, seed=7)
    for _ in range(20):  # the reference's greedy continuation, one decode step at a time
        nxt = chunked_logits(ref, ids, [len(ids)])[-1].argmax()
        ids.append(int(nxt))
    chunks = [23] + [1] * 20
    assert_matches_reference(ours.logits(ids, chunks), ref, ids, chunks, TOL[dtype])


def test_prompts_cross_many_windows(setup: tuple) -> None:
    """Sanity of the configs themselves: short prompts cross many windows and index_topk < rows."""
    _, ours, _ = setup
    cfg = ours.model.cfg
    assert cfg.sliding_window < 45
    rates = [r for t, r in cfg.compress_rates.items() if t in cfg.layer_types]
    assert all(45 // r >= 2 for r in rates)
    if "compressed_sparse_attention" in cfg.layer_types:
        assert cfg.index_topk < 45 // cfg.compress_rates["compressed_sparse_attention"]
