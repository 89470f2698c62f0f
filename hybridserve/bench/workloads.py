"""Benchmark workloads: what each request asks for, reproducible from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hybridserve.tokenizer import Tokenizer


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids for /v1/completions
    output_len: int
    messages: list[dict[str, str]] = field(default_factory=list)  # chat: the conversation so far
    conversation: int = -1  # multi-turn: which conversation this turn belongs to
    prompt_len: int = 0


def _random_text(rng: random.Random, tokenizer: Tokenizer | None, n: int, vocab: list[str]) -> str:
    """About ``n`` tokens of text: random vocabulary pieces (re-tokenising may shift the count a little)."""
    if tokenizer is None:
        return " ".join(rng.choice(vocab) for _ in range(n))
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(n)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "that",
    "it",
    "was",
    "her",
    "not",
    "be",
    "as",
    "his",
    "he",
    "had",
    "for",
    "with",
    "you",
    "which",
    "she",
]


def random_workload(
    seed: int, n: int, input_len: int, output_len: int, range_ratio: float, tokenizer: Tokenizer | None
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = _length(rng, input_len, range_ratio)
        out.append(
            BenchRequest(
                _random_text(rng, tokenizer, k, _WORDS), _length(rng, output_len, range_ratio), prompt_len=k
            )
        )
    return out


def shared_prefix_workload(
    seed: int,
    num_prefixes: int,
    suffixes_per_prefix: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    tokenizer: Tokenizer | None,
) -> list[BenchRequest]:
    """N distinct long prefixes, each followed by many short suffixes, interleaved."""
    rng = random.Random(seed)
    prefixes = [_random_text(rng, tokenizer, prefix_len, _WORDS) for _ in range(num_prefixes)]
    out = []
    for _ in range(suffixes_per_prefix):
        for p in prefixes:
            suffix = _random_text(rng, tokenizer, suffix_len, _WORDS)
            out.append(BenchRequest(p + " " + suffix, output_len, prompt_len=prefix_len + suffix_len))
    rng.shuffle(out)
    return out


def multi_turn_workload(
    seed: int, conversations: int, turns: int, turn_len: int, output_len: int, tokenizer: Tokenizer | None
) -> list[BenchRequest]:
    """Chat conversations; each turn is sent after the previous answer arrives (see the runner)."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        for _ in range(turns):
            user = _random_text(rng, tokenizer, turn_len, _WORDS)
            out.append(
                BenchRequest(
                    user,
                    output_len,
                    messages=[{"role": "user", "content": user}],
                    conversation=c,
                    prompt_len=turn_len,
                )
            )
    return out
