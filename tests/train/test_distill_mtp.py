"""Self-distillation of the MTP layer: the trunk cannot change, the depth chain is the engine's drafting."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from hybridserve.train.checkpoint import load_mtp, load_trunk
from hybridserve.train.distill_data import trunk_streams
from hybridserve.train.distill_mtp import (
    checkpoint_trunk_digest,
    distill_step,
    freeze_trunk,
    trunk_digest,
    write,
)
from hybridserve.train.mtp import MTP_PREFIX
from hybridserve.train.mtp_chain import chain_logits, chain_mask
from tests.tiny_models import VOCAB

ASSET = Path(__file__).resolve().parents[2] / "hybridserve" / "assets" / "austen-v4"
# sha256 of the bundled trunk's tensors (names, dtypes, shapes, bytes; mtp.0.* excluded), as the chat
# fine-tune's fifth run wrote them (hybridserve/train/finetune_chat.py; the pretrained trunk's was
# d3cb7616...4757) and the MTP layer's second distillation kept them.
BUNDLED_TRUNK_SHA256 = "7b401da5202e11405274e2dd1f34688b8e73e8219c26e47a61338c5f845f4c63"


def test_bundled_trunk_tensors_are_the_trained_ones() -> None:
    assert checkpoint_trunk_digest(ASSET) == BUNDLED_TRUNK_SHA256


def _ids(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_a_distillation_step_changes_the_mtp_layer_only(mtp_checkpoint: Callable[[str], Path]) -> None:
    folder = mtp_checkpoint("mixed")
    trunk = load_trunk(folder)
    mtp = load_mtp(folder, trunk)
    params = freeze_trunk(trunk, mtp)
    assert {id(p) for p in params} == {id(p) for p in mtp.parameters()}
    assert not any(p.requires_grad for p in trunk.parameters())
    before = trunk_digest(trunk.state_dict().items())
    mtp_before = {k: v.clone() for k, v in mtp.state_dict().items()}
    ids = _ids(2, 24, 0)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(2):
        loss = distill_step(trunk, mtp, optimizer, ids, trunk_streams(trunk, ids), depth=2)
    assert loss > 0
    assert trunk_digest(trunk.state_dict().items()) == before
    assert any(not torch.equal(v, mtp.state_dict()[k]) for k, v in mtp_before.items())


def test_write_replaces_mtp_tensors_and_keeps_every_trunk_byte(
    mtp_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = mtp_checkpoint("mixed")
    trunk = load_trunk(folder)
    mtp = load_mtp(folder, trunk)
    with torch.no_grad():
        for p in mtp.parameters():
            p.add_(0.01)
    (tmp_path / "work").mkdir()
    torch.save(mtp.state_dict(), tmp_path / "work" / "best.pt")
    args = argparse.Namespace(checkpoint=folder, out=tmp_path / "out", work=tmp_path / "work")
    assert write(args) == checkpoint_trunk_digest(folder)
    old, new = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert old.keys() == new.keys()
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all(k.startswith(MTP_PREFIX) for k in changed)
    reloaded = load_mtp(tmp_path / "out", load_trunk(tmp_path / "out"))
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in mtp.state_dict().items())


def test_chain_mask_shows_each_depth_the_rows_the_engine_keeps() -> None:
    """Bases 0..2, depth 2, window 2: depth-2 base t (position t+1) sees depth-1 row t and itself."""
    mask, pos = chain_mask(3, 2, 2, torch.device("cpu"))
    seen = (mask[0, 0] == 0).int().tolist()
    assert pos.tolist() == [0, 1, 2, 1, 2]
    assert seen == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],  # depth 2, base 0, position 1: depth-1 row 0, own row
        [0, 1, 0, 0, 1],  # depth 2, base 1, position 2: depth-1 row 1 (row 0 is out of the window)
    ]


def test_chain_equals_the_engine_drafting_formula(mtp_checkpoint: Callable[[str], Path]) -> None:
    """Depth 2 at every base t, all at once, equals the MTP layer run as the engine drafts from t: the
    trunk's rows 0..t as one sequence, then the layer again on its own output at t and token t+2."""
    from tests.models.test_mtp import _model_card_drafts

    folder = mtp_checkpoint("mixed")
    trunk = load_trunk(folder)
    mtp = load_mtp(folder, trunk)
    ids = _ids(1, 14, 5)
    with torch.no_grad():
        d1, d2 = chain_logits(mtp, trunk_streams(trunk, ids), ids, 2, trunk.model.embed_tokens, trunk.lm_head)
    row = ids[0].tolist()
    for t in range(d2.shape[1]):
        prefix = row[: t + 1]
        # the formula drafts from the prefix's last position with the next token row[t + 1]
        first, second = _model_card_drafts(trunk, mtp, prefix, row[t + 1], 2, feed=[row[t + 2]])
        assert first == int(d1[0, t].argmax()) and second == int(d2[0, t].argmax())
