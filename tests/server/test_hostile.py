"""Hostile requests, by class: each gets a 4xx OpenAI-style JSON error or a normal 200, and afterwards the
server is healthy and serves a normal request. Plus abort isolation, truthful OpenAPI, cross-site POSTs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.config import EngineConfig
from hybridserve.server.openai_api import build_app
from hybridserve.server.serving import ServerSettings
from tests.server.conftest import API_KEY, Server
from tests.tiny_models import VOCAB

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"content-type": "application/json"}


def _post(server: Server, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    raw = body if isinstance(body, bytes) else None
    return httpx.post(
        f"{server.url}{path}",
        json=None if raw is not None else body,
        content=raw,
        headers={**JSON, **AUTH, **(headers or {})},
        timeout=60,
    )


def _assert_served_or_refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code in (200, 400), r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        for w in words:
            assert w in err["message"], err


def _assert_still_serving(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# Class 1: sampling parameters that look legal but are extreme (they used to kill the engine thread).
EXTREME_SAMPLING = [
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 1e300},
    {"repetition_penalty": 1e-300, "temperature": 1e-6},
    {"temperature": 1e-9},
    {"temperature": 1e-5, "presence_penalty": 2, "frequency_penalty": 2, "repetition_penalty": 1e-30},
    {"temperature": 2, "presence_penalty": -2, "frequency_penalty": -2},
    {"top_k": VOCAB},
    {"top_k": 1, "top_p": 1e-300, "min_p": 1.0},
    {"min_p": 1.0, "temperature": 1e-7},
    {"min_tokens": 4, "stop_token_ids": [0, 1, 2, 3, VOCAB - 1], "max_tokens": 6},
    {"min_tokens": 6, "max_tokens": 6, "ignore_eos": False},
    {"logprobs": 5, "temperature": 1e-8},
    {"seed": 2**63 - 1, "n": 3, "temperature": 1.0},
    {"seed": -(2**63), "n": 2, "temperature": 1.0},
]


@pytest.mark.parametrize("extra", EXTREME_SAMPLING, ids=lambda e: ",".join(e))
def test_extreme_sampling_parameters_never_kill_the_engine(server: Server, extra: dict) -> None:
    body = {"model": server.model, "prompt": "Hi there", "max_tokens": 4, **extra}
    r = _post(server, "/v1/completions", body)
    _assert_served_or_refused(r)
    if r.status_code == 200:
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
    _assert_still_serving(server)


# Class 1 and 3: values outside the engine's real limits get a 400 that names the field.
OUT_OF_DOMAIN = [
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1], "min_tokens": 2}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [2**70]}, "prompt"),
    ({"prompt": [[1, 2], [3, VOCAB + 7]]}, "prompt"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 17}, "n"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
]


@pytest.mark.parametrize(("extra", "field"), OUT_OF_DOMAIN, ids=lambda e: str(e)[:40])
def test_values_outside_the_engines_limits_get_a_400_naming_the_field(
    server: Server, extra: dict, field: str
) -> None:
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    _assert_served_or_refused(r, field)
    _assert_still_serving(server)


NON_FINITE = [
    b'{"model": "M", "prompt": "Hi", "temperature": NaN}',
    b'{"model": "M", "prompt": "Hi", "top_p": Infinity}',
    b'{"model": "M", "prompt": "Hi", "repetition_penalty": -Infinity}',
    b'{"model": "M", "prompt": "Hi", "presence_penalty": NaN}',
]


@pytest.mark.parametrize("body", NON_FINITE)
def test_non_finite_numbers_get_a_400(server: Server, body: bytes) -> None:
    r = _post(server, "/v1/completions", body.replace(b'"M"', f'"{server.model}"'.encode()))
    assert r.status_code == 400, r.text
    _assert_served_or_refused(r)
    _assert_still_serving(server)


# Class 3: text that is not well-formed UTF-8 (a lone surrogate survives JSON decoding).
ILL_FORMED = [
    ("/v1/completions", b'{"model": "M", "prompt": "Hi \\ud800 there"}', "prompt"),
    ("/v1/completions", b'{"model": "M", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", b'{"model": "M", "prompt": "Hi", "stop": ["\\ud83d"]}', "stop"),
    (
        "/v1/chat/completions",
        b'{"model": "M", "messages": [{"role": "user", "content": "\\udc00"}]}',
        "content",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), ILL_FORMED)
def test_ill_formed_utf8_gets_a_400(server: Server, path: str, body: bytes, field: str) -> None:
    r = _post(server, path, body.replace(b'"M"', f'"{server.model}"'.encode()))
    assert r.status_code == 400, r.text
    _assert_served_or_refused(r, field, "UTF-8")
    _assert_still_serving(server)


# Class 6: a request that can never fit is a 400, not a 429 the client would retry forever.
def test_a_fan_out_beyond_the_queue_is_a_400_not_a_429(server: Server) -> None:
    body = {"model": server.model, "prompt": ["a", "b", "c", "d", "e"], "n": 5, "max_tokens": 2}
    r = _post(server, "/v1/completions", body)  # 25 sequences, the queue holds 24
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    assert r.json()["error"]["code"] == "too_many_sequences"
    _assert_still_serving(server)


# Class 2: abort is exact, by the full id of one request.
def test_one_client_cannot_abort_another(server: Server) -> None:
    """My abort ends my request's choices and nothing else; guessed ids end nothing; their request is
    proven untouched by its own abort finding it still running afterwards. Neither request has a token
    limit (~500 tokens to the context length) while its abort comes a few round trips after its first
    event, so neither can finish first on a busy machine (60 tokens could, and made this test flaky)."""
    body = {"model": server.model, "prompt": "hi", "max_tokens": None, "ignore_eos": True, "stream": True}
    body["n"] = 2
    with (
        httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as mine,
        httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as theirs,
    ):
        my_lines = (line for line in mine.iter_lines() if line)
        their_lines = (line for line in theirs.iter_lines() if line)
        my_id = next(my_lines).split('"id":"')[1].split('"')[0]
        their_id = next(their_lines).split('"id":"')[1].split('"')[0]
        assert my_id.startswith("cmpl-") and len(my_id) >= len("cmpl-") + 32 and their_id != my_id
        r = httpx.post(f"{server.url}/v1/requests/{my_id}/abort", headers=AUTH)
        assert r.status_code == 200 and r.json()["aborted"] == 2, r.text
        mine_rest = "".join(my_lines)
        for guess in ("cmpl", "cmpl-", their_id[:-1], their_id + "-0", their_id + "-0-0", "*", my_id):
            r = httpx.post(f"{server.url}/v1/requests/{guess}/abort", headers=AUTH)
            assert r.status_code == 404, (guess, r.text)
        r = httpx.post(f"{server.url}/v1/requests/{their_id}/abort", headers=AUTH)
        assert r.status_code == 200 and r.json()["aborted"] == 2, r.text  # still running: untouched
        theirs_rest = "".join(their_lines)
    assert mine_rest.count('"finish_reason":"abort"') == 2
    assert theirs_rest.count('"finish_reason":"abort"') == 2 and '"finish_reason":"length"' not in theirs_rest


# The schema tells the truth, /health is JSON and answers HEAD, and cross-site simple POSTs are refused.
def test_openapi_documents_errors_and_event_streams(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "413", "429", "503"} <= set(answers), answers.keys()
        assert "text/event-stream" in answers["200"]["content"]
    assert "404" in schema["paths"]["/v1/requests/{request_id}/abort"]["post"]["responses"]


def test_health_is_json_and_answers_head(server: Server) -> None:
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.head(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_posts_a_browser_could_send_cross_site_are_refused(
    tiny_checkpoint: Callable[[str], Path], content_type: str | None
) -> None:
    config = EngineConfig(model=str(tiny_checkpoint("mixed")), block_tokens=8, enforce_eager=True)
    client = TestClient(build_app(config, ServerSettings(model_name="m")))  # no key, engine not started
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "m", "prompt": "hi"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/cache/reset", "/v1/requests/x/abort"):
        r = client.post(path, content=body, headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
        # A JSON content type (a preflighted request from a browser) or a key passes this check.
        assert client.post(path, content=body, headers=JSON).status_code != 415
        with_key = client.post(path, content=body, headers={**headers, "Authorization": "Bearer x"})
        assert with_key.status_code != 415
