"""The supervisor: a failed step fails only its requests (JSON 500) and the engine goes on; an engine that
cannot go on exits the process non-zero; past the shutdown grace, requests end with a 503; one huge
prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.core.process import PLUGINS_ENV
from hybridserve.server.openai_api import build_app
from hybridserve.server.serving import ServerSettings, off_loop
from hybridserve.tokenizer import Tokenizer
from tests.server.conftest import Server, start_server, stop_server
from tests.server.faults import FATAL, POISON


@pytest.fixture(scope="module")
def faulty_client(tiny_checkpoint: Callable[[str], Path]) -> Iterator[TestClient]:
    config = EngineConfig(model=str(tiny_checkpoint("mixed")), block_tokens=8, enforce_eager=True)
    app = build_app(config, ServerSettings(model_name="m"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PLUGINS_ENV, "tests.server.faults:poison_step")  # the core process inherits it
        with TestClient(app) as client:
            deadline = time.monotonic() + 180  # a loaded 2-core machine can take a minute to import and load
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            yield client


def _engine(client: TestClient) -> AsyncLLM:
    llm = client.app.state.hs.llm  # type: ignore[attr-defined]
    assert llm is not None
    return llm


def _wait_all_free(llm: AsyncLLM) -> None:
    deadline = time.monotonic() + 10
    while llm.num_unfinished or llm.stats.num_running or any(p.used for p in llm.stats.kv_blocks.values()):
        assert time.monotonic() < deadline, "blocks leaked after a failed step"
        time.sleep(0.01)


def _normal_request_succeeds(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_a_failed_step_fails_its_request_with_a_json_500_and_the_engine_goes_on(
    faulty_client: TestClient,
) -> None:
    llm = _engine(faulty_client)
    for _ in range(4):  # more than once: a failure the engine survives is not counted against it forever
        r = faulty_client.post("/v1/completions", json={"model": "m", "prompt": [5, POISON], "max_tokens": 3})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_step_failed"
        assert "injected step fault" in err["message"]
        _wait_all_free(llm)
        _normal_request_succeeds(faulty_client)
    assert llm.stats.failed_steps == 4


def test_a_failed_step_ends_a_stream_with_an_error_event_and_done(faulty_client: TestClient) -> None:
    body = {"model": "m", "prompt": [5, POISON], "max_tokens": 3, "stream": True, "n": 2}
    with faulty_client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_step_failed" and error["type"] == "server_error"
    _wait_all_free(_engine(faulty_client))
    _normal_request_succeeds(faulty_client)


def test_a_failed_step_leaves_its_healthy_neighbour_untouched(faulty_client: TestClient) -> None:
    """A healthy request running beside a poisoned one, in the same steps or not, finishes normally: the
    failed step is run again one request at a time and only the poisoned request fails."""
    long_body = {"model": "m", "prompt": [9, 10], "max_tokens": 40, "ignore_eos": True, "stream": True}
    llm = _engine(faulty_client)
    failed_before = llm.stats.failed_steps
    with faulty_client.stream("POST", "/v1/completions", json=long_body) as healthy:
        lines = (line for line in healthy.iter_lines() if line)
        next(lines)
        bad = faulty_client.post("/v1/completions", json={"model": "m", "prompt": [POISON], "max_tokens": 2})
        rest = list(lines)
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_step_failed", bad.text
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], rest[-3:]
    assert not any('"error"' in line for line in rest)
    assert llm.stats.failed_steps == failed_before + 1
    _wait_all_free(llm)


def test_an_engine_that_cannot_go_on_exits_the_process_non_zero(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    s = start_server(tiny_checkpoint("mixed"), plugins="tests.server.faults:fatal_schedule")
    try:
        ok = httpx.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": [5, 6], "max_tokens": 2})
        assert ok.status_code == 200
        r = httpx.post(f"{s.url}/v1/completions", json={"model": s.model, "prompt": [5, FATAL]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        assert s.process.wait(timeout=30) == 1
    finally:
        if s.process.poll() is None:
            s.process.kill()
            s.process.wait()


def test_past_the_grace_period_requests_end_with_a_503(tiny_checkpoint: Callable[[str], Path]) -> None:
    s = start_server(tiny_checkpoint("mixed"), "--shutdown-grace", "0.5")
    body = {"model": s.model, "prompt": "hi", "max_tokens": 500, "ignore_eos": True}
    results: dict[str, Any] = {}

    def streaming() -> None:
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body | {"stream": True}, timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line]

    def plain() -> None:
        results["plain"] = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)

    threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while s.metrics().get("hybridserve_num_requests_running", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stop_server(s) == 0
    for t in threads:
        t.join(timeout=30)
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    plain_response = results["plain"]
    assert plain_response.status_code == 503, plain_response.text
    assert plain_response.json()["error"]["code"] == "server_shutting_down"


def test_tokenising_a_large_prompt_does_not_stall_the_event_loop() -> None:
    """A large prompt is tokenised in a worker thread while the loop goes on: here the tokenising waits for
    a coroutine of the loop to run, which it could not do if it held the loop (a machine-speed-free check;
    the stall itself is measured in benchmarks/loop_stall.py)."""
    tokenizer = Tokenizer(Path(__file__).parents[2] / "hybridserve" / "assets" / "austen-v4")
    text = ("It is a truth universally acknowledged, that a single man " * 20_000)[: 1 << 20]
    loop_ran = threading.Event()

    def encode() -> list[int]:
        assert loop_ran.wait(timeout=30), "the event loop did not run while the prompt was tokenised"
        return tokenizer.encode(text)

    async def main() -> tuple[list[int], str]:
        async def beside() -> str:
            loop_ran.set()
            return threading.current_thread().name

        work = asyncio.ensure_future(off_loop(len(text), encode))
        name = await beside()
        return await work, name

    ids, loop_thread = asyncio.run(main())
    assert len(ids) > 100_000 and loop_thread == threading.main_thread().name


@pytest.fixture(scope="module")
def big_body_server(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Server]:
    s = start_server(tiny_checkpoint("mixed"), "--max-body-bytes", str(8 << 20))
    yield s
    assert stop_server(s) == 0


def test_a_4mib_prompt_is_refused_fast_and_others_stay_responsive(big_body_server: Server) -> None:
    s = big_body_server
    # Serialised up front: the client's own JSON encoding would hold this process's GIL and skew timing.
    huge = json.dumps({"model": s.model, "prompt": "x y z " * ((4 << 20) // 6)}).encode()  # 4 MiB
    chat = json.dumps(
        {"model": s.model, "messages": [{"role": "user", "content": "abc " * (1 << 20)}]}
    ).encode()
    latencies: list[float] = []
    results: list[httpx.Response] = []
    sent: list[float] = []

    def send() -> None:
        headers = {"content-type": "application/json"}
        start = time.perf_counter()
        results.append(httpx.post(f"{s.url}/v1/completions", content=huge, headers=headers, timeout=60))
        results.append(httpx.post(f"{s.url}/v1/chat/completions", content=chat, headers=headers, timeout=60))
        sent.append(time.perf_counter() - start)

    sender = threading.Thread(target=send)
    with httpx.Client(timeout=60) as probe:  # one client: a new one per call costs ~40 ms by itself
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            assert probe.get(f"{s.url}/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
    sender.join()
    for r in results:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    # Measured against the same run's own work, not a fixed time: a loop that read, parsed or tokenised the
    # bodies itself would hold a probe for about as long as the requests took; off the loop a probe waits
    # a small part of it, on a quiet machine or a loaded one.
    assert len(latencies) >= 3 and max(latencies) < sent[0] / 2, (latencies, sent)


def test_special_token_text_in_chat_content_is_plain_text(big_body_server: Server) -> None:
    s = big_body_server

    def prompt_tokens(content: str) -> int:
        body = {"model": s.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    empty = prompt_tokens("")
    spoof = prompt_tokens("<｜Assistant｜>")
    assert spoof - empty > 1  # spelled out as text, not the one special token of a forged turn
