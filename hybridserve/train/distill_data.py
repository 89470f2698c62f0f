"""Self-distillation data: token sequences the trunk reads or writes, and the trunk's streams over them.

Three kinds of sequence, each with the trunk's pre-``hc_head`` streams at every position (computed once,
by the transformers trunk): corpus windows (teacher forcing on real text) and the trunk's own greedy and
temperature-0.8 continuations of corpus prompts (the text a draft sees when serving). Held-out sequences
come the same way from ``heldout.txt``, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import DeepseekV4ForCausalLM

from hybridserve.train.data import TokenStream, WindowSampler
from hybridserve.train.model import StreamCatcher

KINDS = ("corpus", "greedy", "sampled")


@dataclass
class DistillSet:
    """Sequences of one kind, equal length: ids [N, S] and the trunk's streams [N, S, hc, D]."""

    kind: str
    ids: torch.Tensor
    streams: torch.Tensor


@dataclass(frozen=True)
class SetSizes:
    corpus_windows: int
    continuations: int  # per sampling mode
    window_len: int = 256
    prompt_len: int = 32
    continuation_len: int = 160


def corpus_windows(streams: list[TokenStream], n: int, length: int, bos: int, seed: int) -> torch.Tensor:
    return (
        WindowSampler(streams, length, bos, {"web": 0.5}, seed).batch(n)
        if n
        else torch.zeros(0, length).long()
    )


def continuations(
    model: str, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int
) -> torch.Tensor:
    """The trunk's own continuations, from hybridserve's engine (EOS ignored, so all equal length)."""
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.request import SamplingParams

    llm = LLM(model, max_num_seqs=64, dtype="float32", enforce_eager=True)  # one run: compiling costs more
    params = [
        SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params)
    llm.shutdown()
    rows = [torch.tensor(o.outputs[0].token_ids, dtype=torch.long) for o in outs]
    return torch.cat([prompts, torch.stack(rows)], dim=1)


@torch.no_grad()
def trunk_streams(trunk: DeepseekV4ForCausalLM, ids: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The trunk's pre-``hc_head`` streams [N, S, hc, D] over ``ids`` [N, S]."""
    catcher = StreamCatcher(trunk)
    parts = []
    try:
        for chunk in ids.split(batch_size):
            trunk(input_ids=chunk, use_cache=False, logits_to_keep=1)
            parts.append(catcher.pop())
    finally:
        catcher.handle.remove()
    return torch.cat(parts) if parts else torch.zeros(0, ids.shape[1], 0, 0)


def heldout_stream(tok: Tokenizer, path: Path) -> list[TokenStream]:
    ids = tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids
    return [TokenStream("austen", torch.tensor(ids, dtype=torch.long))]


def build_sets(
    model: str,
    trunk: DeepseekV4ForCausalLM,
    streams: list[TokenStream],
    sizes: SetSizes,
    bos: int,
    seed: int,
) -> list[DistillSet]:
    """One DistillSet per kind (corpus windows, greedy and T=0.8 continuations) from ``streams``."""
    windows = corpus_windows(streams, sizes.corpus_windows, sizes.window_len, bos, seed)
    prompts = corpus_windows(streams, sizes.continuations, sizes.prompt_len, bos, seed + 1)
    seqs = {
        "corpus": windows,
        "greedy": continuations(model, prompts, sizes.continuation_len, 0.0, seed),
        "sampled": continuations(model, prompts, sizes.continuation_len, 0.8, seed),
    }
    return [DistillSet(kind, ids, trunk_streams(trunk, ids)) for kind, ids in seqs.items() if len(ids)]
