"""Helpers for speculative-decoding tests: prompts, an oracle drafter, poisoning of rolled-back cache rows
and the check against the batch-1 reference."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridserve.cache.pool import NULL_BLOCK
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.sample.rejection_sampler import RejectionSampler
from tests.proofs import prove_mismatch
from tests.tiny_models import VOCAB

POISON = 1e4
MAX_NEW = 12
KV = "48MiB"  # pools of a few MiB per engine (the default 1 GiB is resident once zeroed)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def spec_prompts(n: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """``n`` random prompts of 1-40 tokens after ``shared_prefix`` common ones."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared_prefix,), generator=g).tolist()
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


def poison_after_steps(core: EngineCore) -> None:
    """Poison every unverified cache row after each of ``core``'s steps."""
    step = core.step

    def poisoned_step() -> list:
        outputs = step()
        poison_unverified_rows(core)
        return outputs

    core.step = poisoned_step  # type: ignore[method-assign]


def check_greedy(folder: Path, prompts: list[list[int]], outputs: list, expected: list[list[int]]) -> None:
    """Every output has MAX_NEW tokens; at most a quarter differ from ``expected``, each with a proof."""
    mismatched = 0
    for prompt, out, exp in zip(prompts, outputs, expected, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_NEW and out.outputs[0].finish_reason == "length"
        if ours != exp:
            mismatched += 1
            print(prove_mismatch(folder, prompt, ours))
    assert mismatched <= len(prompts) // 4


def mtp(k: int, adaptive: bool = False) -> dict[str, object]:
    """A speculative_config; fixed k by default, so that every step drafts and verifies."""
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}


@contextmanager
def oracle_drafts(continuations: dict[tuple[int, ...], list[int]], wrong: float = 0.3) -> Iterator[None]:
    """Drafts come from the known greedy continuation of each prompt, each replaced by a wrong token with
    probability ``wrong`` (a fixed hash of the position), so verification accepts runs of every length.

    The MTP layer still runs and its own draft is computed; only the token it proposes is replaced.
    """
    real = RejectionSampler.draft

    def draft(self: RejectionSampler, logits: torch.Tensor, requests: list[Request]) -> tuple:
        tokens, probs = real(self, logits, requests)
        for i, req in enumerate(requests):
            target = continuations.get(tuple(req.prompt_token_ids))
            at = len(req.output_token_ids) + len(req.spec_token_ids)
            if (
                target is None
                or at >= len(target)
                or list(req.output_token_ids) != target[: len(req.output_token_ids)]
            ):
                continue
            h = hashlib.sha256(repr((req.prompt_token_ids, at)).encode()).digest()[0] / 256
            tokens[i] = target[at] if h >= wrong else (target[at] + 1) % logits.shape[1]
        return tokens, probs

    RejectionSampler.draft = draft  # type: ignore[method-assign]
    try:
        yield
    finally:
        RejectionSampler.draft = real  # type: ignore[method-assign]


def poison_unverified_rows(core: EngineCore) -> None:
    """Fill every cache row at or past each running request's verified end with a huge value.

    Rows of rejected tokens stay in the kept blocks after a rollback; if any forward read one as
    visible before rewriting it, the value would swamp attention and change the tokens. (Finite, not
    NaN: rows gathered but masked out get weight 0, and 0 * NaN would be NaN.)
    """
    for req in core.scheduler.running:
        if not core.coordinator.has_request(req.request_id):
            continue
        tables = core.coordinator.block_tables(req.request_id)
        for name, pool in core.pools.pools.items():
            rows_per_block, stride = pool.plan.rows_per_block, pool.plan.spec.stride
            first = req.num_computed_tokens // stride
            slots = [
                block * rows_per_block + row % rows_per_block
                for row in range(first, len(tables[name]) * rows_per_block)
                if (block := tables[name][row // rows_per_block]) != NULL_BLOCK
            ]
            if not slots:
                continue
            idx = torch.tensor(slots)
            for t in pool.tensors.values():
                t.index_fill_(0, idx.to(t.device), POISON)
