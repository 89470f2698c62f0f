"""Our paged MTP layer against the training-time MTP module (transformers' decoder layer inside)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool import BlockPoolSet
from hybridserve.layers.forward_batch import ForwardBatch
from hybridserve.models.loader import load_model
from hybridserve.train.mtp import MTPModule
from tests.reference import reference_model
from tests.tiny_models import VOCAB, add_random_mtp


def _with_mtp(src: Path, dst: Path) -> MTPModule:
    """Copy a tiny checkpoint and add random ``mtp.0.*`` tensors in the official layout."""
    return add_random_mtp(src, dst)  # type: ignore[no-any-return]


def _batch(ids: list[int], positions: range, tables: dict[str, list[int]], block: int) -> ForwardBatch:
    n = len(ids)
    return ForwardBatch(
        torch.tensor(ids),
        torch.tensor(list(positions)),
        torch.zeros(n, dtype=torch.long),
        torch.tensor([positions[-1] + 1]),
        {g: torch.tensor([t]) for g, t in tables.items()},
        block,
        torch.arange(n),
    )


def test_mtp_logits_match_the_training_module(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_checkpoint("mixed")
    reference_mtp = _with_mtp(src, tmp_path / "with_mtp")
    model = load_model(tmp_path / "with_mtp", torch.float32, "cpu")
    assert len(model.mtp) == 1
    plan = build_plan(model.cache_specs(include_mtp=True), 8, 2, 64, num_blocks=32)
    pools = BlockPoolSet(plan, "cpu")
    coord = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    assert coord.allocate("r", 0, len(ids))
    tables = coord.block_tables("r")
    streams = model(_batch(ids, range(len(ids)), tables, 8), pools.tensors())
    # MTP at positions t = 0..28 reads the trunk's streams at t and the token at t+1, in two chunks.
    got = []
    for lo, hi in ((0, 11), (11, 29)):
        mtp_streams = model.mtp_forward(
            streams[lo:hi], _batch(ids[lo + 1 : hi + 1], range(lo, hi), tables, 8), pools.tensors()
        )
        got.append(model.mtp_logits(mtp_streams))
    ref = reference_model(src)
    with torch.no_grad():
        trunk = ref.model(torch.tensor([ids]), output_hidden_states=True)
        ref_streams = _pre_head_streams(ref, ids)
        expected = reference_mtp(
            ref_streams[:, :-1], torch.tensor([ids[1:]]), ref.model.embed_tokens, ref.lm_head
        )
    assert trunk is not None
    torch.testing.assert_close(torch.cat(got), expected[0], atol=2e-5, rtol=0)


def _pre_head_streams(ref: object, ids: list[int]) -> torch.Tensor:
    """The reference trunk's last decoder-layer output (the streams before hc_head)."""
    captured: list[torch.Tensor] = []
    layer = ref.model.layers[-1]  # type: ignore[attr-defined]
    hook = layer.register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        ref(torch.tensor([ids]))  # type: ignore[operator]
    finally:
        hook.remove()
    return captured[0]
