"""Prefill/decode disaggregation with compiled steps: a prefill worker running the compiled prefill graph
and a decode worker running compiled decode steps (each compiled before it answers, and only the kind it
runs, to keep the test short) give the greedy tokens of one co-located eager engine, and each really ran
its compiled path. Not expert parallel: expert-parallel steps stay eager by policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from tests.server.conftest import Server, spawn_server, stop_server, wait_healthy
from tests.server.test_disagg import ENGINE, Router, _post, _router_thread, _wait_router

COMPILED = {
    "prefill": ("--compile-prefill", "--no-compile-decode", "--no-compile-in-background"),
    "decode": ("--compile-decode", "--no-compile-prefill", "--no-compile-in-background"),
}
PROMPTS = [[(7 * i + k) % 300 + 5 for i in range(n)] for k, n in enumerate((3, 40, 17))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Callable[[str], Path]) -> Iterator[tuple[Router, dict[str, Server]]]:
    folder = tiny_checkpoint("mixed")
    plugins = "tests.server.eager_graphs:install"
    sides = {
        mode: spawn_server(folder, "--disaggregation-mode", mode, *ENGINE, *COMPILED[mode], plugins=plugins)
        for mode in ("prefill", "decode")
    }
    router = None
    try:
        for w in sides.values():
            wait_healthy(w, timeout_s=420)  # model loads at once on a small, shared machine
        router = _router_thread([sides["prefill"]], [sides["decode"]])
        _wait_router(router)
        yield router, sides
    finally:
        if router is not None:
            router.stop()
        for w in sides.values():
            stop_server(w)


def test_compiled_sides_equal_one_eager_engine(
    pair: tuple[Router, dict[str, Server]], tiny_checkpoint: Callable[[str], Path]
) -> None:
    router, sides = pair
    llm = LLM(
        str(tiny_checkpoint("mixed")),
        block_tokens=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    body = {"model": sides["decode"].model, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    got = []
    for prompt in PROMPTS:
        r = _post(router.url, "/v1/completions", dict(body, prompt=prompt))
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == expected
    sides["decode"].wait_idle()
    prefill, decode = (sides[m].metrics() for m in ("prefill", "decode"))
    assert prefill['hybridserve_engine_steps_by_path_total{path="prefill_graph"}'] >= len(PROMPTS)
    assert decode['hybridserve_engine_steps_by_path_total{path="decode_graph"}'] >= MAX_TOKENS - 2
    assert decode["hybridserve_kv_handoff_transfers_total"] == len(PROMPTS)
