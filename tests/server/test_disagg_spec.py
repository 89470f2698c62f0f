"""MTP x disaggregation: prefill and decode workers both run ``--speculative-config`` (1 + 1, behind the
router); the prefill worker hands the prompt's MTP window over with the other groups, so the decode
worker drafts from its first step. Greedy output equals the co-located non-speculative server's, and the
decode worker's metrics show drafts proposed and accepted and MTP window bytes received.

Drafts come from an oracle (the known continuation, 30% deliberately wrong) installed in the decode
worker's engine core, so that verification accepts runs of every length and rolls back at every offset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from tests.distributed.spec_oracle import ORACLE_ENV, write_oracle
from tests.server.conftest import Server, spawn_server, stop_server, wait_healthy
from tests.server.test_disagg import ENGINE, Router, _choices, _post, _router_thread, _wait_router

SPEC = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}))
PROMPTS = [[(7 * i + k) % 300 + 5 for i in range(n)] for k, n in enumerate((3, 17, 40, 9))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def router(
    mtp_checkpoint: Callable[[str], Path], server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Router, Server]]:
    folder = mtp_checkpoint("mixed")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm = LLM(str(folder), block_tokens=8, kv_cache_memory="48MiB", enforce_eager=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    oracle = tmp_path_factory.mktemp("oracle") / "oracle.json"
    write_oracle(oracle, PROMPTS, plain)
    flags = (*ENGINE, *SPEC, "--served-model-name", server.model)
    prefill = spawn_server(folder, "--disaggregation-mode", "prefill", *flags)
    os.environ[ORACLE_ENV] = str(oracle)  # spawn_server's environment: the decode worker's engine core
    try:
        decode = spawn_server(
            folder, "--disaggregation-mode", "decode", *flags, plugins="tests.distributed.spec_oracle:install"
        )
    finally:
        del os.environ[ORACLE_ENV]
    workers = [prefill, decode]
    r = None
    try:
        for w in workers:
            wait_healthy(w, timeout_s=420)
        r = _router_thread([prefill], [decode])
        _wait_router(r)
        yield r, decode
    finally:
        if r is not None:
            r.stop()
        for w in workers:
            stop_server(w)


def test_speculative_decode_worker_equals_colocated(router: tuple[Router, Server], server: Server) -> None:
    r, decode = router
    bodies = [
        ("/v1/completions", {"model": server.model, "prompt": p, "temperature": 0, "max_tokens": MAX_TOKENS})
        for p in PROMPTS
    ]
    bodies.append(
        ("/v1/chat/completions", {"model": server.model, "temperature": 0, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "Hello there"}]})
    )  # fmt: skip
    for path, body in bodies:
        got, ref = _post(r.url, path, body), _post(server.url, path, body)
        assert got.status_code == ref.status_code == 200, got.text
        assert _choices(got.json()) == _choices(ref.json())
    decode.wait_idle()
    m = decode.metrics()
    assert m["hybridserve_spec_decode_num_drafts_total"] > 0
    assert m["hybridserve_spec_decode_num_accepted_tokens_total"] > 0
    assert m['hybridserve_kv_handoff_bytes_total{group="mtp_kv"}'] > 0
