"""The bundled model served by the engine: greedy tokens equal transformers', with and without
prefix caching, at concurrency 1 and 16."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import default_model_path
from tests.proofs import prove_mismatch
from tests.reference import reference_greedy

BUNDLED = Path(default_model_path())
MAX_NEW = 24
MAX_PROVEN = 1  # of 16 completions (measured: 0); each must still carry its proof (tests/proofs.py)


def _prompts(llm: LLM) -> list[list[int]]:
    assert llm.tokenizer is not None
    text = (BUNDLED / "heldout.txt").read_text()
    starts = [0, 900, 2300, 4100, 6000, 8100, 9900, 12000]
    return [llm.tokenizer.encode(text[s : s + 60 + 40 * i]) for i, s in enumerate(starts)]


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(BUNDLED), max_num_seqs=1, enforce_eager=True)
    prompts = _prompts(llm)
    return prompts, [reference_greedy(BUNDLED, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("seqs", [1, 16])
@pytest.mark.parametrize("caching", [True, False])
def test_bundled_greedy_equals_transformers(prompts_and_reference: tuple, seqs: int, caching: bool) -> None:
    prompts, expected = prompts_and_reference
    llm = LLM(
        str(BUNDLED),
        max_num_seqs=seqs,
        max_num_batched_tokens=64,
        enable_prefix_caching=caching,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts + prompts, params)  # the second copy hits the prefix cache when it is on
    proofs = [
        prove_mismatch(BUNDLED, prompts[i % len(prompts)], out.outputs[0].token_ids)
        for i, out in enumerate(outs)
        if out.outputs[0].token_ids != expected[i % len(prompts)]
    ]
    print(*map(str, proofs), sep="\n")
    assert len(proofs) <= MAX_PROVEN, f"{len(proofs)} proven mismatches exceed the cap {MAX_PROVEN}"
    if caching:
        assert sum(o.num_cached_tokens for o in outs[len(prompts) :]) > 0
    assert llm.engine.pools.all_free()
