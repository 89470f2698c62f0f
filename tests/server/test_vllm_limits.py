"""What vLLM clients send is served as vLLM serves it: many stop strings, 20 logprobs on both endpoints,
404 ``model_not_found`` for an unknown model, and a clear 400 for image or audio parts."""

from __future__ import annotations

import httpx
import pytest

from hybridserve.server.errors import APIError
from hybridserve.server.protocol import MAX_STOP_STRINGS, CompletionRequest
from hybridserve.server.serving import ServerSettings, sampling_params
from tests.server.conftest import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def test_many_stop_strings_are_served(server: Server) -> None:
    stops = [f"never-{i}" for i in range(40)]  # lm-eval's generate tasks send more than OpenAI's 4
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 4, "stop": stops}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text


def test_stop_strings_beyond_the_cap_name_it(server: Server) -> None:
    body = {"model": server.model, "prompt": "Hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and f"{MAX_STOP_STRINGS:,}" in r.json()["error"]["message"], r.text


def test_twenty_logprobs_on_completions(server: Server) -> None:
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2, "logprobs": 20, "temperature": 0}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    # keyed by token text, as in OpenAI's format: tokens that decode alike (byte pieces, "�") share a key
    assert len(tops) == 2 and all(len(t) > 5 for t in tops), tops


def test_twenty_top_logprobs_on_chat(server: Server) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 20,
    }
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 20 for c in content)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_more_than_max_logprobs_is_a_400(server: Server, path: str) -> None:
    if path == "/v1/completions":
        body = {"model": server.model, "prompt": "Hi", "logprobs": 21}
    else:
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "top_logprobs": 21,
        }
    r = _post(server, path, body)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text


def test_max_logprobs_lowers_the_limit() -> None:
    settings = ServerSettings(model_name="m", max_logprobs=3)
    body = CompletionRequest(model="m", prompt="Hi", logprobs=4)
    with pytest.raises(APIError, match="--max-logprobs") as refused:
        sampling_params(body, settings, 4, body.logprobs)
    assert refused.value.status == 400 and refused.value.param == "logprobs"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_unknown_model_is_a_404_model_not_found(server: Server, path: str) -> None:
    body: dict = {"model": "gpt-4o", "prompt": "Hi"}
    if path == "/v1/chat/completions":
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}
    r = _post(server, path, body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_image_and_audio_parts_get_a_clear_400(server: Server, part: dict) -> None:
    content = [{"type": "text", "text": "what is this?"}, part]
    body = {"model": server.model, "messages": [{"role": "user", "content": content}]}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "text only" in err["message"] and part["type"] in err["message"], err
    assert err["param"] == "messages.0.content" and "valid string" not in err["message"]
