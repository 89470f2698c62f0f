"""``max_tokens = 1`` over HTTP: one token per choice, streaming or not, completions and chat, n > 1."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _body(server: Server, kind: str, stream: bool) -> tuple[str, dict]:
    # ignore_eos: a sampled first token may be EOS (finish_reason "stop"), which the bundled model, taught
    # to end its turns, sometimes samples at T = 0.8
    common = {"model": server.model, "max_tokens": 1, "n": 2, "stream": stream, "temperature": 0.8}
    common["ignore_eos"] = True
    if kind == "chat":
        return "/v1/chat/completions", common | {"messages": [{"role": "user", "content": "Hello there"}]}
    return "/v1/completions", common | {"prompt": "It is a truth"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_one_token_per_choice(server: Server, kind: str, stream: bool) -> None:
    path, body = _body(server, kind, stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        data = r.json()
        assert data["usage"]["completion_tokens"] == 2
        assert sorted(c["index"] for c in data["choices"]) == [0, 1]
        assert all(c["finish_reason"] == "length" for c in data["choices"])
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
    assert finishes == ["length", "length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
