"""``hybridserve serve --data-parallel-size 2 --enable-expert-parallel``: the API as before, per-rank and
per-expert metrics, abort; a rank that dies takes the server down with an error within seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.distributed.faults import KILL
from tests.server.conftest import start_server, stop_server


def _complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_expert_parallel_server_metrics_abort_and_a_dying_rank(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    server = start_server(
        tiny_checkpoint("mixed"),
        "--data-parallel-size", "2", "--enable-expert-parallel", "--served-model-name", "x",
        plugins="tests.distributed.faults:kill_on_token",
    )  # fmt: skip
    try:
        for n in (5, 17, 9):
            r = _complete(server.url, list(range(3, 3 + n)), 6)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        with httpx.stream(  # a stream left after its first chunk: aborted, its blocks freed
            "POST", f"{server.url}/v1/completions", timeout=60,
            json={"model": "x", "prompt": [5] * 12, "max_tokens": 200, "stream": True, "ignore_eos": True},
        ) as stream:  # fmt: skip
            next(stream.iter_lines())
        server.wait_idle()
        m = server.metrics()
        for rank in ("0", "1"):
            assert f'hybridserve_dp_rank_num_requests_running{{rank="{rank}"}}' in m
            assert any(
                k.startswith(f'hybridserve_dp_rank_kv_blocks_used{{group="swa_kv",rank="{rank}"')
                or k.startswith(f'hybridserve_dp_rank_kv_blocks_used{{rank="{rank}",group="swa_kv"')
                for k in m
            )
        expert_rows = {k: v for k, v in m.items() if k.startswith("hybridserve_expert_tokens_total")}
        assert len(expert_rows) == 4 and sum(expert_rows.values()) > 0
        start = time.monotonic()
        r = _complete(server.url, [KILL] * 4, 6)
        assert r.status_code >= 500 and "error" in r.json()
        assert server.process.wait(timeout=15) != 0
        assert time.monotonic() - start < 15
    finally:
        stop_server(server)
