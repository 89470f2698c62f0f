"""The router's handoff latency: each choice's KV pull time, measured on the decode worker, reaches the
router's /metrics (``hybridserve_router_handoff_seconds{url}``) from JSON answers and streams alike, and
the stream a client gets carries no trace of it (every line of it is JSON).

One prefill and one decode worker on the tiny model behind an in-process router.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from hybridserve.bench.server_process import parse_metrics
from tests.server.conftest import Server, spawn_server, stop_server, wait_healthy
from tests.server.test_disagg import ENGINE, Router, _post, _router_thread, _stream, _wait_router

PROMPT = [(7 * i) % 300 + 5 for i in range(19)]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint: Callable[[str], Path]) -> Iterator[tuple[Router, Server]]:
    folder = tiny_checkpoint("mixed")
    workers = [spawn_server(folder, "--disaggregation-mode", mode, *ENGINE) for mode in ("prefill", "decode")]
    router = None
    try:
        for w in workers:
            wait_healthy(w, timeout_s=420)  # model loads at once on a small, shared machine
        router = _router_thread(workers[:1], workers[1:])
        _wait_router(router)
        yield router, workers[1]
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            stop_server(w)


def test_each_pull_time_reaches_the_router(pair: tuple[Router, Server]) -> None:
    router, decode = pair
    body = {"model": decode.model, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    answer = _post(router.url, "/v1/completions", dict(body, prompt=PROMPT, n=2))
    assert answer.status_code == 200, answer.text
    pulled = answer.json()["kv_transfer_params"]["handoff_seconds"]
    assert len(pulled) == 2 and all(s > 0 for s in pulled)
    chat = dict(body, messages=[{"role": "user", "content": "Hello there"}])
    events = _stream(router.url, "/v1/chat/completions", chat)  # parses every line: a comment fails it
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    decode.wait_idle()
    ours = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=10).text)
    worker = decode.metrics()
    label = f'{{url="{decode.url}"}}'
    count, total = (ours[f"hybridserve_router_handoff_seconds_{k}{label}"] for k in ("count", "sum"))
    assert count == worker["hybridserve_kv_handoff_transfers_total"] == 3
    assert total == pytest.approx(worker["hybridserve_kv_handoff_seconds_total"])
    assert total > sum(pulled) > 0
