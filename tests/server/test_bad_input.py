"""Bad input and overload: a clear OpenAI-style error, never a crash, a hang or a leaked block."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.server.openai_api import build_app
from hybridserve.server.serving import ServerSettings
from tests.server.conftest import API_KEY, Server, spawn_server, start_server, stop_server, wait_healthy

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: Server, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else None
    return httpx.post(
        f"{server.url}{path}",
        json=None if content is not None else body,
        content=content,
        headers={"content-type": "application/json", **(AUTH if headers is None else headers)},
        timeout=30,
    )


def _assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"]


BAD_COMPLETIONS = [
    (b"{not json", "not valid JSON"),
    ({"model": "M", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": "M", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "M", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"model": "M", "prompt": "hi", "n": 1000}, "n"),
    ({"model": "M", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"model": "M", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "M", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "M", "prompt": []}, "prompt"),
    ({"model": "M"}, "prompt"),
]


@pytest.mark.parametrize(("body", "word"), BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(server: Server, body: object, word: str) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = body | {"model": server.model}
    _assert_error(_post(server, "/v1/completions", body), 400, word)
    assert httpx.get(f"{server.url}/health").status_code == 200


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        "json_schema",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize(("body", "word"), BAD_CHATS)
def test_bad_chat_requests_get_400(server: Server, body: dict, word: str) -> None:
    _assert_error(_post(server, "/v1/chat/completions", {"model": server.model, **body}), 400, word)


def test_prompt_beyond_what_the_server_holds_gets_400_with_numbers(server: Server) -> None:
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": [5] * 500, "max_tokens": 100})
    _assert_error(r, 400, "500 tokens", "max_tokens is 100", "at most 512")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_body_over_the_limit_gets_413(server: Server) -> None:
    big = {"model": server.model, "prompt": "x" * 100_000}
    _assert_error(_post(server, "/v1/completions", big), 413, "larger than")

    def chunked():  # type: ignore[no-untyped-def]
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"y" * 10_000
        yield b'"}'

    r = httpx.post(
        f"{server.url}/v1/completions",
        content=chunked(),
        headers={**AUTH, "content-type": "application/json"},
    )
    _assert_error(r, 413, "larger than")


def test_api_key_is_required(server: Server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    _assert_error(_post(server, "/v1/completions", body, headers={}), 401, "API key")
    _assert_error(_post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert _post(server, "/v1/completions", body).status_code == 200


def test_overload_gets_429_with_retry_after(server: Server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def flood() -> list[tuple[int, str | None, bytes]]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as c, contextlib.AsyncExitStack() as stack:

            async def open_stream() -> httpx.Response:
                return await stack.enter_async_context(
                    c.stream("POST", f"{server.url}/v1/completions", json=body)
                )

            responses = await asyncio.gather(*(open_stream() for _ in range(48)))
            return [
                (
                    r.status_code,
                    r.headers.get("retry-after"),
                    await r.aread() if r.status_code != 200 else b"",
                )
                for r in responses
            ]  # leaving the stack disconnects the streams that were admitted

    results = asyncio.run(flood())
    refused = [(h, b) for status, h, b in results if status == 429]
    assert len(refused) >= 48 - 8 - 24 and all(h for h, _ in refused)
    assert b"capacity" in refused[0][1] and b'"rate_limit_error"' in refused[0][1]
    assert all(status in (200, 429) for status, _, _ in results)


def test_client_disconnect_frees_blocks(server: Server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        next(lines)
        assert server.kv_blocks_used() > 0
    server.wait_idle(timeout=5)  # the request was aborted, not left to run 400 steps


def test_non_streaming_disconnect_frees_blocks(server: Server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    server.wait_idle(timeout=5)


def test_abort_endpoint(server: Server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = (line for line in r.iter_lines() if line)
        first = next(lines)
        rid = first.split('"id":"')[1].split('"')[0]
        aborted = httpx.post(f"{server.url}/v1/requests/{rid}/abort", headers=AUTH)
        assert aborted.status_code == 200
        rest = list(lines)
    assert '"finish_reason":"abort"' in "".join(rest) and rest[-1] == "data: [DONE]"
    _assert_error(httpx.post(f"{server.url}/v1/requests/nope/abort", headers=AUTH), 404)


def _request_in_flight(s: Server) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """A 40-token completion on a thread, returned once it holds KV blocks; ``result["r"]``: its response."""
    result: dict[str, httpx.Response] = {}
    body = {"model": s.model, "prompt": "hi", "max_tokens": 40, "ignore_eos": True}
    t = threading.Thread(
        target=lambda: result.update(r=httpx.post(f"{s.url}/v1/completions", json=body, timeout=30))
    )
    t.start()
    deadline = time.monotonic() + 10
    while s.kv_blocks_used() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return t, result


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_checkpoint: Callable[[str], Path]) -> None:
    s = start_server(tiny_checkpoint("mixed"), "--shutdown-grace", "20")
    t, result = _request_in_flight(s)
    assert stop_server(s) == 0
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["finish_reason"] == "length"


def test_ctrl_c_to_the_process_group_drains_like_sigterm(tiny_checkpoint: Callable[[str], Path]) -> None:
    """A terminal's Ctrl-C signals every process of the group, the engine core too: in-flight requests
    still finish and the server exits 0 (the core used to die of KeyboardInterrupt and fail them)."""
    s = wait_healthy(spawn_server(tiny_checkpoint("mixed"), "--shutdown-grace", "20", new_session=True))
    t, result = _request_in_flight(s)
    os.killpg(s.process.pid, signal.SIGINT)
    try:
        assert s.process.wait(timeout=30) == 0
    finally:
        if s.process.poll() is None:
            os.killpg(s.process.pid, signal.SIGKILL)
            s.process.wait()
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["finish_reason"] == "length"


def test_health_is_503_until_the_engine_is_ready(tiny_checkpoint: Callable[[str], Path]) -> None:
    release = threading.Event()

    def slow_engine(config: EngineConfig) -> AsyncLLM:
        release.wait(30)
        return AsyncLLM(config)

    config = EngineConfig(model=str(tiny_checkpoint("mixed")), block_tokens=8, enforce_eager=True)
    app = build_app(config, ServerSettings(model_name="m"), make_engine=slow_engine)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_ready"
        release.set()
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
