"""The PD router guards its edge exactly as the server does (the same validation module): the same
answers to bad bodies, the 415 rule, every error an OpenAI-style JSON body, the client's bytes forwarded
as sent; and schemathesis fuzzing of the router with a prefill and a decode worker behind it (the checks
of benchmarks/fuzz_api.py, as tests/server/test_fuzz.py runs them on the server)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from benchmarks.fuzz_api import call_and_check, config, fuzzed, kv_blocks_used_once_idle
from hybridserve.router.app import RouterSettings, build_router_app
from hybridserve.router.forward import with_fields
from tests.server.conftest import REFERENCE_ENGINE, Server, spawn_server, wait_healthy
from tests.server.test_disagg import Router, _router_thread, _wait_router

MODEL = "fuzz-model"
KEY = REFERENCE_ENGINE[1]
AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
MAX_EXAMPLES = 30  # per operation: a router, two workers and this process share a small machine

OPENAPI = build_router_app(RouterSettings(["http://unused:1"], ["http://unused:2"])).openapi()
schema = fuzzed(
    schemathesis.openapi.from_dict(OPENAPI, config=config(MAX_EXAMPLES, deterministic=True, coverage=True))
)


@dataclass
class Edge:
    router: Router
    prefill: Server
    decode: Server


@pytest.fixture(scope="module")
def edge(tiny_checkpoint: Callable[[str], Path]) -> Iterator[Edge]:
    folder = tiny_checkpoint("mixed")
    flags = (
        *REFERENCE_ENGINE,
        "--kv-transfer-timeout",
        "5",
        "--served-model-name",
        MODEL,
        "--max-queue",
        "64",
    )
    workers = [spawn_server(folder, "--disaggregation-mode", mode, *flags) for mode in ("prefill", "decode")]
    router: Router | None = None
    try:
        for w in workers:
            wait_healthy(w, timeout_s=420)
        router = _router_thread(workers[:1], workers[1:])
        _wait_router(router)
        yield Edge(router, *workers)
        for w in workers:
            assert kv_blocks_used_once_idle(w.url) == 0, f"a request leaked blocks on {w.url}"
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.process.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()


def _both(
    edge: Edge, path: str, raw: bytes, headers: dict[str, str]
) -> tuple[httpx.Response, httpx.Response]:
    """(the router's answer, the decode worker's own answer) to the same bytes."""

    def post(url: str) -> httpx.Response:
        return httpx.post(f"{url}{path}", content=raw, headers=headers, timeout=60)

    return post(edge.router.url), post(edge.decode.url)


BAD = [
    b'{"model": "M", "prompt": "Hi \\ud800 there"}',  # a lone surrogate
    b'{"model": "M", "messages": [{"role": "user", "content": "\\udc00"}]}',
    b'{"model": "M", "prompt": "Hi", "temperature": NaN}',
    b'{"model": "M", "prompt": "Hi", "top_p": Infinity}',
    b'{"model": "M", "prompt": "Hi", "user": ' + b"[" * 3000 + b"]" * 3000 + b"}",  # deep nesting
    b'{"model": "M", "prompt": "Hi", "user": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"model": "M", "prompt": ' + b"9" * 5000 + b"}",
    b'{"model": "M", "prompt": "Hi", "max_tokens": 1e400}',
    b'{"model": "M", "prompt": [1, 2, 3]',
    b"[1, 2, 3]",
    b'"just a string"',
    b"\xff\xfe{}",
    b'{"model": "M", "prompt": "Hi", "logprobs": 21}',
    b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
    b'{"model": "nope", "prompt": "Hi", "max_tokens": 1}',
]


@pytest.mark.parametrize("raw", BAD, ids=range(len(BAD)))
def test_the_router_answers_bad_bodies_exactly_as_the_server(edge: Edge, raw: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    raw = raw.replace(b'"M"', json.dumps(MODEL).encode())
    routed, direct = _both(edge, path, raw, AUTH)
    assert routed.status_code == direct.status_code and 400 <= routed.status_code < 500, routed.text[:300]
    assert routed.headers["content-type"] == "application/json"
    assert routed.json() == direct.json()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_post_a_browser_could_send_cross_site_is_a_415(edge: Edge, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/cache/reset", "/v1/requests/x/abort"):
        r = httpx.post(f"{edge.router.url}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)


def test_the_clients_bytes_are_forwarded_as_sent() -> None:
    sent = b'{"model": "m",  "prompt": "caf\\u00e9", "temperature": 0.10000000000000001, "stream": true}\n'
    out = with_fields(sent, {"stream": False, "kv_transfer_params": {"do_remote_decode": True}})
    assert out.startswith(sent.rstrip()[:-1]) and out.endswith(
        b'"stream":false,"kv_transfer_params":{"do_remote_decode":true}}'
    )
    decoded = json.loads(out)
    assert decoded["stream"] is False and decoded["prompt"] == "café" and decoded["kv_transfer_params"]
    assert with_fields(b"{ }", {"a": 1}) == b'{"a":1}' and with_fields(sent, {}) == sent


def test_a_served_request_through_the_router_equals_the_workers_answer_shape(edge: Edge) -> None:
    body = {"model": MODEL, "prompt": "It is a truth", "max_tokens": 6, "temperature": 0, "stop": ["x"] * 40}
    r = httpx.post(f"{edge.router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_router_serves_the_fuzzed_schema(edge: Edge) -> None:
    assert httpx.get(f"{edge.router.url}/openapi.json", timeout=10).json()["paths"] == OPENAPI["paths"]


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=False)
def test_fuzz_the_router(case: schemathesis.Case, edge: Edge) -> None:
    call_and_check(case, edge.router.url, KEY, MODEL)
