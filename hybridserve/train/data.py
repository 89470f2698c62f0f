"""Token streams and training / validation windows. Every window starts with the bos token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from hybridserve.train.corpus import Document


@dataclass
class TokenStream:
    """All documents of one source, tokenized and concatenated; each document starts with bos."""

    source: str
    ids: torch.Tensor  # int64 [N]


def encode_documents(tok: Tokenizer, docs: Sequence[Document], bos_id: int) -> list[TokenStream]:
    by_source: dict[str, list[int]] = {}
    encodings = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    for doc, enc in zip(docs, encodings, strict=True):
        by_source.setdefault(doc.source, []).extend([bos_id, *enc.ids])
    return [TokenStream(src, torch.tensor(ids, dtype=torch.long)) for src, ids in by_source.items()]


class WindowSampler:
    """Random training windows ``[bos] + stream[o : o + seq_len - 1]``.

    A source is picked with probability proportional to ``weight * tokens``, then a uniform offset.
    """

    def __init__(
        self, streams: list[TokenStream], seq_len: int, bos_id: int, weights: dict[str, float], seed: int
    ) -> None:
        self.streams = [s for s in streams if len(s.ids) >= seq_len]
        if not self.streams:
            raise ValueError(f"no source has at least seq_len={seq_len} tokens")
        self.seq_len = seq_len
        self.bos_id = bos_id
        mass = torch.tensor(
            [weights.get(s.source, 1.0) * len(s.ids) for s in self.streams], dtype=torch.float64
        )
        self.probs = mass / mass.sum()
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        picks = torch.multinomial(self.probs, batch_size, replacement=True, generator=self.gen)
        rows = []
        for pick in picks.tolist():
            ids = self.streams[pick].ids
            start = int(torch.randint(0, len(ids) - self.seq_len + 2, (1,), generator=self.gen))
            body = ids[start : start + self.seq_len - 1]
            rows.append(torch.cat([torch.tensor([self.bos_id]), body]))
        return torch.stack(rows)


def eval_windows(ids: torch.Tensor, seq_len: int, bos_id: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Non-overlapping ``[bos] + chunk`` windows over a token sequence (the last one may be shorter)."""
    if max_tokens:
        ids = ids[:max_tokens]
    step = seq_len - 1
    bos = torch.tensor([bos_id])
    return [torch.cat([bos, ids[i : i + step]]) for i in range(0, len(ids) - 2, step)]


def batched(windows: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Group equal-length windows into batches (shorter tail windows go alone)."""
    batches: list[torch.Tensor] = []
    current: list[torch.Tensor] = []
    for w in windows:
        if current and (len(current) == batch_size or len(w) != len(current[0])):
            batches.append(torch.stack(current))
            current = []
        current.append(w)
    if current:
        batches.append(torch.stack(current))
    return batches
