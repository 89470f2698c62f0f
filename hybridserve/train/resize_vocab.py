"""Grow a trained trunk's vocabulary: embedding, output head and hash-routing table get rows for new tokens.

New embedding rows: a BPE word's is the mean of the rows of the two tokens it merges (so it starts out
meaning what its spelling meant); an added token's is the mean of all trained rows. New output-head rows
are the mean of the trained head rows, so no new token is predicted before fine-tuning teaches it.
New ``tid2eid`` rows: two distinct experts per token from a seeded generator, as at initialisation.
The MTP layer shares the embedding and head, so it needs nothing of its own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

from hybridserve.train.v4_tokens import NewToken


def embedding_rows(old: torch.Tensor, new: list[NewToken]) -> torch.Tensor:
    """``old`` [V, D] with a row per new token appended (in ``token_id`` order, ids from V on)."""
    rows = [*old]
    mean = old.mean(dim=0)
    for token in sorted(new, key=lambda t: t.token_id):
        if token.token_id != len(rows):
            raise ValueError(f"new token ids must follow the vocabulary: {token.token_id} != {len(rows)}")
        rows.append(torch.stack([rows[p] for p in token.parts]).mean(dim=0) if token.parts else mean)
    return torch.stack(rows)


def hash_rows(table: torch.Tensor, num_experts: int, count: int, seed: int) -> torch.Tensor:
    """``table`` [V, k] with ``count`` rows of k distinct random experts appended."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.rand(count, num_experts, generator=gen).argsort(dim=-1)[:, : table.shape[1]]
    return torch.cat([table, extra.to(table.dtype)])


@torch.no_grad()
def resize_vocab(trunk: DeepseekV4ForCausalLM, new: list[NewToken], seed: int) -> None:
    """Resize ``trunk`` in place to ``vocab_size + len(new)`` tokens."""
    embed = trunk.model.embed_tokens
    head = trunk.lm_head
    size = embed.weight.shape[0] + len(new)
    rows = embedding_rows(embed.weight.data, new)
    trunk.model.embed_tokens = nn.Embedding(size, rows.shape[1], embed.padding_idx, _weight=rows)
    mean_head = head.weight.data.mean(dim=0, keepdim=True).expand(len(new), -1)
    trunk.lm_head = nn.Linear(head.in_features, size, bias=False)
    trunk.lm_head.weight.data = torch.cat([head.weight.data, mean_head])
    for module in trunk.modules():
        if isinstance(module, DeepseekV4HashRouter):
            table = hash_rows(module.get_buffer("tid2eid"), module.num_experts, len(new), seed)
            module.register_buffer("tid2eid", table, "tid2eid" not in module._non_persistent_buffers_set)
    trunk.config.vocab_size = size
