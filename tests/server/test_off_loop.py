"""Request bodies are decoded and validated off the event loop, with FastAPI's answers kept; the loop's
lag is measured and served in /metrics. Checks that hold on any machine: which thread parses, ratios of a
stall to the work, and a deliberate stall seen by the monitor."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import CompletionOutput, Logprob, RequestOutput
from hybridserve.server import body as body_module
from hybridserve.server.body import INLINE_BYTES, parse, parse_off_loop
from hybridserve.server.loop_lag import LoopLagMonitor
from hybridserve.server.openai_api import build_app
from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest
from hybridserve.server.serving import OFF_LOOP_CHARS, ServerSettings, response_size
from hybridserve.tokenizer import Tokenizer
from tests.server.conftest import Server

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}


def _no_engine(config: EngineConfig) -> AsyncLLM:
    raise RuntimeError("no engine in this test")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    """The app with no engine: every request that gets past its body answers 503."""
    app = build_app(
        EngineConfig(model="unused", enforce_eager=True),
        ServerSettings(model_name="m", api_key=KEY),
        _no_engine,
    )
    with TestClient(app) as c:
        yield c


@pytest.fixture
def parse_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []

    def recording(raw: bytes, model: Any) -> Any:
        seen.append(threading.current_thread().name)
        return parse(raw, model)

    monkeypatch.setattr(body_module, "parse", recording)
    return seen


def _big_prompt(n: int = 200_000, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": list(range(n)), **extra}).encode()


def test_a_large_body_is_parsed_in_a_worker_thread(client: TestClient, parse_threads: list[str]) -> None:
    raw = _big_prompt()
    assert len(raw) > INLINE_BYTES
    r = client.post("/v1/completions", content=raw, headers=AUTH)
    assert r.status_code == 503, r.text  # parsed and valid; no engine behind it
    assert len(parse_threads) == 1 and parse_threads[0] != threading.main_thread().name
    loop_thread = client.portal.call(lambda: threading.current_thread().name)  # type: ignore[union-attr]
    assert parse_threads[0] != loop_thread


def test_a_small_body_is_parsed_inline(client: TestClient, parse_threads: list[str]) -> None:
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=AUTH)
    assert r.status_code == 503, r.text
    loop_thread = client.portal.call(lambda: threading.current_thread().name)  # type: ignore[union-attr]
    assert parse_threads == [loop_thread]


BAD_LARGE = [
    (_big_prompt(temperature=-1), 400, "temperature"),
    (_big_prompt()[:-1], 400, "not valid JSON"),
    (_big_prompt().replace(b'"model": "m"', b'"model": "m", "user": "\\ud800"'), 400, "UTF-8"),
    (_big_prompt().replace(b'"model": "m"', b'"model": "m", "top_p": NaN'), 400, "top_p"),
    (_big_prompt().replace(b'"model": "m"', b'"model": "m", "user": ' + b"[" * 5000 + b"]" * 5000), 400, ""),
    (b"\xff\xfe" + _big_prompt(), 400, ""),
]


@pytest.mark.parametrize(("raw", "status", "word"), BAD_LARGE, ids=range(len(BAD_LARGE)))
def test_large_bad_bodies_get_the_answers_small_ones_get(
    client: TestClient, raw: bytes, status: int, word: str
) -> None:
    r = client.post("/v1/completions", content=raw, headers=AUTH)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and word in err["message"], err


def test_an_invalid_large_body_without_the_key_is_a_401_as_before(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", content=_big_prompt(temperature=-1), headers={"content-type": "application/json"}
    )
    assert r.status_code == 401, r.text


def test_the_loop_lag_monitor_sees_a_stall() -> None:
    async def stall() -> float:
        monitor = LoopLagMonitor(CollectorRegistry(), interval_s=0.005)
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # holds the loop, as parsing a big body on it did
        await asyncio.sleep(0.02)
        task.cancel()
        return monitor.worst

    assert asyncio.run(stall()) >= 0.19


def test_a_serving_server_reports_its_loop_lag(server: Server) -> None:
    metrics = server.metrics()
    assert metrics["hybridserve_event_loop_lag_seconds_count"] >= 1
    assert "hybridserve_event_loop_lag_max_seconds" in metrics


async def _worst_gap(work: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """(the loop's longest gap while ``work`` runs, how long it ran)."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done = True
    await ticker
    return max(gaps), took


def test_decoding_millions_of_ids_lets_the_loop_run() -> None:
    tokenizer = Tokenizer(Path(__file__).parents[2] / "hybridserve" / "assets" / "austen-v4")
    ids = list(range(3, 300)) * 10_000
    worst, took = asyncio.run(_worst_gap(lambda: asyncio.to_thread(tokenizer.decode, ids)))
    assert worst < 0.5 * took, (worst, took)  # a decode holding the GIL stalls the loop for all of it


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (CompletionRequest, {"model": "m", "prompt": list(range(1_000_000))}),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": "hi there"}] * 100_000},
        ),
    ],
    ids=["ids", "messages"],
)
def test_parsing_a_large_body_off_the_loop_lets_the_loop_run(model: Any, body: dict) -> None:
    raw = json.dumps(body).encode()
    worst, took = asyncio.run(_worst_gap(lambda: parse_off_loop(raw, model)))
    assert worst < 0.5 * took, (worst, took)


def test_a_response_with_many_logprobs_is_built_off_the_loop() -> None:
    entry = {t: Logprob(-1.0, t + 1) for t in range(21)}
    out = RequestOutput("r", None, [5] * 4_000, [CompletionOutput(0, "x", [6], None, None)], finished=True)
    out.prompt_logprobs = [None] + [entry] * 3_999  # 20 prompt logprobs over 4,000 tokens: ~1.5 s to build
    assert response_size([out]) > OFF_LOOP_CHARS
    out.prompt_logprobs = None
    assert response_size([out]) <= OFF_LOOP_CHARS
