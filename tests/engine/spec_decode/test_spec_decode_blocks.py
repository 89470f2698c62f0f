"""Block accounting under speculation: random workloads of accepts, rejects, aborts and preemptions.

Every step checks pool integrity and poisons every row past each request's verified end; at the end every
pool is back to its free count, and each greedy request that ran to its end produced exactly the tokens
of speculation off (so no rolled-back row was ever read).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request
from tests.engine.spec_decode.spec_helpers import mtp, oracle_drafts, poison_unverified_rows
from tests.tiny_models import VOCAB

MAX_NEW = 12


def _pool_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    lengths = torch.randint(1, 30, (8,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _pool_prompts()


@cache
def _plain(folder: Path) -> dict[tuple[int, ...], list[int]]:
    outs = LLM(str(folder), block_tokens=8, kv_cache_memory="48MiB", enforce_eager=True).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    )
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}


_request = st.tuples(
    st.integers(0, len(PROMPTS) - 1),  # prompt
    st.integers(1, MAX_NEW),  # max_tokens
    st.sampled_from([0.0, 0.0, 0.9]),  # temperature
    st.one_of(st.none(), st.integers(1, 12)),  # abort after this many steps
)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    requests=st.lists(_request, min_size=1, max_size=7),
    k=st.integers(1, 3),
    num_blocks=st.sampled_from([10, 14, 40]),
    budget=st.sampled_from([9, 16, 64]),
    prefix=st.booleans(),
)
def test_pools_return_to_free_and_tokens_never_change(
    mtp_checkpoint: Callable[[str], Path],
    requests: list[tuple[int, int, float, int | None]],
    k: int,
    num_blocks: int,
    budget: int,
    prefix: bool,
) -> None:
    folder = mtp_checkpoint("mixed")
    expected = _plain(folder)
    config = EngineConfig(
        model=str(folder),
        block_tokens=8,
        num_blocks=num_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
        speculative_config=mtp(k),
        enforce_eager=True,
    )
    with oracle_drafts(expected, wrong=0.4):
        core = EngineCore(config)
        reqs = []
        for i, (p, max_tokens, temperature, _) in enumerate(requests):
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
            reqs.append(Request(str(i), list(PROMPTS[p]), params))
            core.add_request(reqs[-1])
        aborted: set[str] = set()
        for step in range(400):
            if not core.has_unfinished_requests():
                break
            core.step()
            core.pools.check_integrity()
            poison_unverified_rows(core)
            for req, (_, _, _, abort_at) in zip(reqs, requests, strict=True):
                if abort_at == step and core.abort_request(req.request_id):
                    aborted.add(req.request_id)
        assert not core.has_unfinished_requests()
    for req, (p, max_tokens, temperature, _) in zip(reqs, requests, strict=True):
        if req.request_id in aborted:
            continue
        assert len(req.output_token_ids) == max_tokens
        if temperature == 0:
            assert list(req.output_token_ids) == expected[tuple(PROMPTS[p])][:max_tokens]
    core.reset_prefix_cache()
    assert core.pools.all_free()
    core.pools.check_integrity()
