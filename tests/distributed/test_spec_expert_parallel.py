"""MTP x expert parallelism: 2 expert-parallel ranks drafting k = 2 give the greedy tokens of one
non-speculative process, token for token, with requests of very different lengths (one rank idles, in
dummy steps, while the other drafts and verifies).

Drafts come from an oracle (the non-speculative continuation, 30% deliberately wrong) installed in each
rank process, so that verification accepts runs of every length and rolls back at every offset; the MTP
layer itself still runs (its MoE dispatching and combining over both ranks) on every drafting step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.core.process import PLUGINS_ENV
from tests.distributed.spec_oracle import ORACLE_ENV, write_oracle
from tests.engine.spec_decode.spec_helpers import KV, mtp, spec_prompts
from tests.proofs import prove_mismatch
from tests.reference import reference_greedy

ENGINE = dict(block_tokens=8, kv_cache_memory=KV, max_num_seqs=4, max_num_batched_tokens=32)


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=14 if i % 2 else 3, ignore_eos=True) for i in range(n)]


def test_expert_parallel_mtp_equals_one_process_without_speculation(
    tiny_checkpoint: Callable[[str], Path],
    mtp_checkpoint: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = str(mtp_checkpoint("mixed"))
    prompts = spec_prompts(6, seed=11)
    params = _params(len(prompts))
    plain = [
        o.outputs[0].token_ids for o in LLM(folder, **ENGINE, enforce_eager=True).generate(prompts, params)
    ]  # type: ignore[arg-type]
    write_oracle(tmp_path / "oracle.json", prompts, plain)
    monkeypatch.setenv(ORACLE_ENV, str(tmp_path / "oracle.json"))
    monkeypatch.setenv(PLUGINS_ENV, "tests.distributed.spec_oracle:install")
    llm = LLM(
        folder,
        data_parallel_size=2,
        enable_expert_parallel=True,
        speculative_config=mtp(2),
        **ENGINE,
        enforce_eager=True,
    )  # type: ignore[arg-type]
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        ranks = llm.engine.client.rank_stats  # type: ignore[union-attr]
    finally:
        llm.shutdown()
    assert got == plain
    assert all(s.spec_num_drafts > 0 for s in ranks.values()), ranks
    assert sum(s.spec_num_accepted_tokens for s in ranks.values()) > 0
    base = tiny_checkpoint("mixed")  # the same trunk: its transformers reference, up to proven ties
    for prompt, ours, p in zip(prompts, plain, params, strict=True):
        if ours != reference_greedy(base, prompt, p.max_tokens or 0):
            print(prove_mismatch(base, prompt, ours))
