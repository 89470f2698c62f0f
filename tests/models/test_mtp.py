"""Our paged MTP layer against the training-time MTP module (transformers' decoder layer inside)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
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


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _model_card_drafts(
    ref: object, mtp: MTPModule, ids: list[int], first: int, k: int, feed: list[int] | None = None
) -> list[int]:
    """Drafts from the DeepSeek-V4 model card's MTP formula, composed here from transformers' parts:

        x_t = h_proj(hnorm(h_t)) + e_proj(enorm(embed(tok_{t+1})))   (per hyper-connection stream)
        y = block(x)  (one sliding-window decoder layer over the MTP positions, causal)
        logits_{t+2} = head(norm(hc_head(y_t)))

    and for k > 1 the same layer again, one position further, on its own output y and its own draft
    (or, teacher-forced, on ``feed[j]`` at depth j + 2).
    """
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cfg, eps = mtp.config, mtp.config.rms_norm_eps
    embed, head = ref.model.embed_tokens, ref.lm_head  # type: ignore[attr-defined]

    def inputs(h: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        e = mtp.e_proj(_rms(embed(torch.tensor([tokens])), mtp.enorm.weight, eps))
        return mtp.h_proj(_rms(h, mtp.hnorm.weight, eps)) + e.unsqueeze(-2)

    def block(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        pos = torch.arange(n)[None]
        rotary = DeepseekV4RotaryEmbedding(cfg)
        rope = {kind: rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        delta = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        mask = torch.zeros(n, n).masked_fill(~((delta >= 0) & (delta < cfg.sliding_window)), float("-inf"))
        return mtp.block(x, position_embeddings=rope, position_ids=pos, attention_mask=mask[None, None])

    def draft(y_last: torch.Tensor) -> int:
        return int(head(_rms(mtp.hc_head(y_last), mtp.norm.weight, eps))[0, -1].argmax())

    x = inputs(_pre_head_streams(ref, ids), [*ids[1:], first])
    drafts: list[int] = []
    y = block(x)
    for _ in range(k):
        drafts.append(draft(y[:, -1:]))
        token = feed[len(drafts) - 1] if feed and len(drafts) <= len(feed) else drafts[-1]
        x = torch.cat([x, inputs(y[:, -1:], [token])], dim=1)
        y = block(x)
    return drafts


def test_mtp_drafts_match_the_model_card_formula(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """The engine's k = 3 drafts after a prefill, against the formula evaluated on the reference's trunk."""
    from hybridserve.config import EngineConfig
    from hybridserve.engine.core.engine_core import EngineCore
    from hybridserve.engine.request import Request, SamplingParams

    src = tiny_checkpoint("mixed")
    mtp = _with_mtp(src, tmp_path / "with_mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    core = EngineCore(
        EngineConfig(
            model=str(tmp_path / "with_mtp"),
            block_tokens=8,
            kv_cache_memory="48MiB",
            speculative_config=spec,
            enforce_eager=True,
        )
    )
    ref = reference_model(src)
    g = torch.Generator().manual_seed(4)
    for n in (9, 23):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        req = Request(f"r{n}", ids, SamplingParams(temperature=0, max_tokens=8))
        core.add_request(req)
        (out,) = core.step()
        with torch.no_grad():
            expected = _model_card_drafts(ref, mtp, ids, out.new_token_ids[0], 3)
        assert req.spec_token_ids == expected
        core.abort_request(req.request_id)


def _trunk_over_prompt(
    checkpoint: Path, n: int, seed: int
) -> tuple[Any, BlockPoolSet, list[int], dict[str, list[int]], torch.Tensor]:
    """The mixed model with its MTP pools, the trunk's streams over a random n-token prompt -> (model,
    pools, ids, the prompt's block tables, streams)."""
    model = load_model(checkpoint, torch.float32, "cpu")
    plan = build_plan(model.cache_specs(include_mtp=True), 8, 2, 64, num_blocks=32)
    pools = BlockPoolSet(plan, "cpu")
    coord = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    ids = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert coord.allocate("r", 0, len(ids))
    tables = coord.block_tables("r")
    return model, pools, ids, tables, model(_batch(ids, range(len(ids)), tables, 8), pools.tensors())


def _written_then_cleared(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    full = {k: t.clone() for k, t in rows.items()}
    for t in rows.values():
        t.zero_()
    return full


def test_mtp_kv_write_equals_the_rows_of_the_full_layer(mtp_checkpoint: Callable[[str], Path]) -> None:
    """``mtp_write_kv`` (no attention, MoE or head) writes exactly the window rows ``mtp_forward`` writes."""
    model, pools, ids, tables, streams = _trunk_over_prompt(mtp_checkpoint("mixed"), 20, 1)
    mtp_batch = _batch(ids[1:], range(len(ids) - 1), tables, 8)
    rows = pools["mtp_kv"].tensors
    model.mtp_forward(streams[:-1], mtp_batch, pools.tensors())
    full = _written_then_cleared(rows)
    model.mtp_write_kv(streams[:-1], mtp_batch, pools.tensors())
    assert full and all(torch.equal(rows[k], full[k]) for k in full)
    assert any(bool(t.abs().sum() > 0) for t in full.values())


def test_mtp_decode_writes_window_only_rows_before_its_own(mtp_checkpoint: Callable[[str], Path]) -> None:
    """A draft step's window-only rows (``mtp_decode``'s ``kv``) write the rows ``mtp_forward`` writes, in
    the same step as the last position's whole layer, whose streams then match the full layer's there
    (which they would not had it read the cleared rows)."""
    model, pools, ids, tables, streams = _trunk_over_prompt(mtp_checkpoint("mixed"), 12, 2)
    rows = pools["mtp_kv"].tensors
    whole = _batch(ids[1:], range(len(ids) - 1), tables, 8)
    full_out = model.mtp_forward(streams[:-1], whole, pools.tensors())
    full = _written_then_cleared(rows)
    n = len(ids) - 1
    kv = (streams[: n - 1], _batch(ids[1:n], range(n - 1), tables, 8))
    last = _batch(ids[n:], range(n - 1, n), tables, 8)
    out = model.mtp_decode(streams[n - 1 : n], last, pools.tensors(), 64, kv=kv)
    for k in full:  # the same rows up to float rounding: GEMMs of other row counts
        torch.testing.assert_close(rows[k], full[k])
    torch.testing.assert_close(out, full_out[-1:])
