"""``DeepseekV4Model.row_reads``: what the compiled graphs size their row buckets by (the engine never
names a compressed group) equals the metadata's own count of visible rows, branch by branch."""

from __future__ import annotations

import random

import torch

from hybridserve.layers.forward_batch import BatchLayout
from hybridserve.models.attention_meta import visible_rows
from hybridserve.models.deepseek_v4 import DeepseekV4Model
from hybridserve.models.deepseek_v4_config import DeepseekV4Config

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _model(layer_types: list[str]) -> DeepseekV4Model:
    raw = {
        "model_type": "deepseek_v4",
        "vocab_size": 10,
        "hidden_size": 8,
        "moe_intermediate_size": 4,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": 2,
        "head_dim": 16,
        "q_lora_rank": 4,
        "num_experts_per_tok": 1,
        "n_routed_experts": 2,
        "index_head_dim": 8,
        "index_topk": 5,
        "sliding_window": 32,
        "compress_rates": {CSA: 4, HCA: 16},
        "layer_types": layer_types,
    }
    with torch.device("meta"):
        return DeepseekV4Model(DeepseekV4Config.from_dict(raw))


def test_row_reads_equal_visible_rows_per_branch() -> None:
    model, rng = _model([SLIDING, CSA, HCA]), random.Random(0)
    for _ in range(200):
        starts = [rng.randrange(0, 300) for _ in range(rng.randrange(1, 9))]
        ends = [s + rng.randrange(0, 40) for s in starts]
        layout = BatchLayout(tuple(starts), tuple(ends))
        reads = model.row_reads(layout)
        assert reads["csa"] == (visible_rows(layout, 4), 4, 5)
        assert reads["hca"] == (visible_rows(layout, 16), 16, 0)


def test_only_the_branches_some_layer_reads() -> None:
    layout = BatchLayout((0,), (40,))
    assert set(_model([SLIDING, HCA]).row_reads(layout)) == {"hca"}
    assert _model([SLIDING]).row_reads(layout) == {}
