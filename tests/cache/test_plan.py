from __future__ import annotations

import pytest
import torch

from hybridserve.cache.plan import CachePlanError, build_plan
from hybridserve.models.deepseek_v4 import cache_specs
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from tests.cache.helpers import toy_specs


def test_block_tokens_must_be_a_multiple_of_every_stride() -> None:
    with pytest.raises(CachePlanError, match="multiple of group 'rows' stride 4"):
        build_plan(toy_specs(rate=4), 6, 4, 64, num_blocks=10)


def test_num_blocks_gives_every_group_that_many_usable_blocks() -> None:
    plan = build_plan(toy_specs(), 8, 4, 64, num_blocks=10)
    assert [g.usable_blocks for g in plan.groups] == [10, 10, 10]
    assert [g.rows_per_block for g in plan.groups] == [8, 8, 2]
    assert plan.max_request_tokens() == 80


def test_memory_budget_sizes_window_groups_for_the_batch_and_history_with_the_rest() -> None:
    budget = 1 << 20
    plan = build_plan(toy_specs(window=5), 8, 4, 64, memory_bytes=budget)
    win = plan.group("win")
    # 4 sequences x (ceil(5/8) + 2) blocks + a whole prefill budget (64 / 8) + the null block
    assert win.num_blocks == 1 + 4 * 3 + 8
    assert plan.total_bytes <= budget
    rows = plan.group("rows")
    assert budget - plan.total_bytes < rows.block_bytes  # the rest went to history blocks


def test_too_small_a_budget_is_a_clear_error() -> None:
    with pytest.raises(CachePlanError, match="raise --kv-cache-memory"):
        build_plan(toy_specs(), 8, 64, 64, memory_bytes=1000)


def test_deepseek_v4_groups_and_bytes_per_token() -> None:
    cfg = DeepseekV4Config.from_dict(
        {
            "model_type": "deepseek_v4",
            "vocab_size": 10,
            "hidden_size": 8,
            "moe_intermediate_size": 4,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "head_dim": 16,
            "q_lora_rank": 4,
            "num_experts_per_tok": 1,
            "n_routed_experts": 2,
            "index_head_dim": 8,
            "sliding_window": 32,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "layer_types": [
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
        }
    )
    specs = {s.name: s for s in cache_specs(cfg, torch.bfloat16)}
    assert set(specs) == {"swa_kv", "csa_state", "csa_rows", "hca_state", "hca_rows"}
    assert specs["swa_kv"].bytes_per_token == 3 * 16 * 2  # every layer, one latent row per token
    assert specs["csa_state"].bytes_per_token == (2 * 16 + 2 * 16 + 2 * 8 + 2 * 8) * 2
    assert specs["csa_rows"].bytes_per_token == (16 + 8) * 2 / 4
    assert specs["hca_rows"].bytes_per_token == 16 * 2 / 16
    assert specs["swa_kv"].window_tokens == 31 and specs["csa_state"].window_tokens == 7
    plan = build_plan(list(specs.values()), 32, 4, 128, memory_bytes=8 << 20)
    text = plan.describe(request_tokens=1000)
    assert "csa_rows" in text and "fit at once" in text


def test_a_plan_whose_window_cannot_hold_one_prefill_chunk_is_refused_naming_the_fix() -> None:
    plan = build_plan(toy_specs(window=5), 8, 4, 64, num_blocks=4)  # 64 + 5 tokens need 9 blocks
    assert plan.max_request_tokens() == 0
    with pytest.raises(CachePlanError, match=r"'win' has 4 blocks .* needs 9: .*--max-num-batched-tokens"):
        plan.check_usable()
    build_plan(toy_specs(window=5), 8, 4, 64, num_blocks=10).check_usable()
