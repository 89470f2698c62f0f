"""The server with no compile flags: it answers at once, its steps compile in the background, /metrics
says when it reached full speed (also while idle), and its greedy tokens are the eager engine's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hybridserve.bench.server_process import parse_metrics
from hybridserve.engine.llm import LLM
from hybridserve.engine.request import SamplingParams
from tests.server.conftest import API_KEY, spawn_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow_file(seconds=60)  # scheduled first: never the run's tail

PROMPT = [5, 9, 14, 3, 27, 11]


def _completion(url: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(
        f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text)


def test_the_default_server_answers_then_reaches_full_speed(tiny_checkpoint: Callable[[str], Path]) -> None:
    folder = tiny_checkpoint("mixed")
    eager = LLM(str(folder), block_tokens=8, enforce_eager=True)
    want = eager.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=12))
    server = wait_healthy(
        spawn_server(
            folder, "--no-enforce-eager", "--api-key", API_KEY, plugins="tests.server.eager_graphs:install"
        )
    )
    try:
        assert (
            _completion(server.url, folder.name) == want[0].outputs[0].text
        )  # answered while compiling, or after
        deadline = time.monotonic() + 300
        while not _metrics(server.url).get("hybridserve_full_speed"):  # idle: the core still reports it
            assert time.monotonic() < deadline, "the server never reported full speed"
            time.sleep(0.2)
        metrics = _metrics(server.url)
        parts = {k for k in metrics if k.startswith("hybridserve_compiled_part_ready_seconds")}
        assert len(parts) == 3 and metrics["hybridserve_full_speed_seconds"] > 0
        assert _completion(server.url, folder.name) == want[0].outputs[0].text
        after = _metrics(server.url)
        assert after['hybridserve_engine_steps_by_path_total{path="decode_graph"}'] > 0
    finally:
        assert stop_server(server, grace=60) == 0
