"""The soak's request kinds: each sends one request (or a small exchange) and judges the answer.

A kind returns an ``Outcome``: the status it got, its latency, and the reason it is wrong if it is. What
is right: a 2xx with a well-formed body (streams end in ``[DONE]``), or the documented refusal for bad
input, always an OpenAI-style JSON error. A 5xx other than a documented 503 is always wrong.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

STOPS = [" the", ",", ".", " and"]
ERROR_FIELDS = {"message", "type", "param", "code"}
JSON = {"content-type": "application/json"}  # bodiless POSTs too: the server refuses others (415)


@dataclass
class Outcome:
    kind: str
    status: int
    latency: float
    problem: str = ""  # empty when the answer is right


@dataclass
class Traffic:
    """What every kind needs: the client, the served model and the prompt material."""

    client: httpx.AsyncClient
    model: str
    roots: list[str]  # shared prompt beginnings (prefix hits, then evictions under a tight pool)
    text: str  # material for the rest of each prompt
    max_body_bytes: int
    headers: dict[str, str]

    def prompt(self, rng: random.Random) -> str:
        start = rng.randrange(0, max(1, len(self.text) - 400))
        tail = self.text[start : start + rng.randrange(10, 160)]
        return rng.choice(self.roots) + tail if rng.random() < 0.6 else tail

    def body(self, rng: random.Random, chat: bool, stream: bool, **extra: object) -> dict:
        body: dict = {"model": self.model, "max_tokens": rng.randrange(1, 9), "stream": stream}
        body["temperature"] = rng.choice([0.0, 0.0, 0.8])
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt(rng)}]
        else:
            body["prompt"] = self.prompt(rng)
        return body | extra


def _error_problem(r: httpx.Response, allowed: set[int]) -> str:
    if r.status_code not in allowed:
        return f"status {r.status_code}: {r.text[:200]}"
    if r.status_code < 300:
        return ""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {r.status_code} without an OpenAI-style JSON error: {r.text[:200]}"
    if not set(error) >= ERROR_FIELDS:
        return f"error body lacks {ERROR_FIELDS - set(error)}"
    return ""


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def _plain(t: Traffic, rng: random.Random, chat: bool, **extra: object) -> tuple[httpx.Response, str]:
    body = t.body(rng, chat, False, **extra)
    r = await t.client.post(_path(chat), json=body, headers=t.headers)
    problem = _error_problem(r, {200, 429, 503})
    if not problem and r.status_code == 200:
        choices = r.json().get("choices", [])
        if len(choices) != body.get("n", 1):
            problem = f"{len(choices)} choices for n={body.get('n', 1)}"
    return r, problem


async def _stream(
    t: Traffic, rng: random.Random, chat: bool, read: int | None = None, **extra: object
) -> tuple[int, str, list[dict]]:
    """Stream one request; stop reading after ``read`` events (a client that goes away)."""
    body = t.body(rng, chat, True, **extra)
    chunks: list[dict] = []
    async with t.client.stream("POST", _path(chat), json=body, headers=t.headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, _error_problem(r, {429, 503}), chunks
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return 200, "", chunks
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 200, f"error event: {chunk['error']}", chunks
            chunks.append(chunk)
            if read is not None and len(chunks) >= read:
                return 200, "", chunks  # leaving the block closes the connection mid-stream
    return 200, "stream ended without [DONE]", chunks


def _timed(kind: str, fn: Callable[[Traffic, random.Random], Awaitable[tuple[int, str]]]) -> Callable:
    async def run(t: Traffic, rng: random.Random) -> Outcome:
        start = time.perf_counter()
        try:
            status, problem = await fn(t, rng)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            status, problem = 0, f"{type(exc).__name__}: {exc}"
        return Outcome(kind, status, time.perf_counter() - start, problem)

    return run


async def completion(t: Traffic, rng: random.Random) -> tuple[int, str]:
    r, problem = await _plain(t, rng, chat=False)
    return r.status_code, problem


async def chat(t: Traffic, rng: random.Random) -> tuple[int, str]:
    r, problem = await _plain(t, rng, chat=True)
    return r.status_code, problem


async def completion_stream(t: Traffic, rng: random.Random) -> tuple[int, str]:
    status, problem, _ = await _stream(t, rng, chat=False)
    return status, problem


async def chat_stream(t: Traffic, rng: random.Random) -> tuple[int, str]:
    status, problem, _ = await _stream(t, rng, chat=True)
    return status, problem


async def fan_out(t: Traffic, rng: random.Random) -> tuple[int, str]:
    n = rng.randrange(2, 4)
    if rng.random() < 0.5:
        r, problem = await _plain(t, rng, chat=rng.random() < 0.5, n=n, temperature=0.8)
        return r.status_code, problem
    status, problem, chunks = await _stream(t, rng, chat=False, n=n, temperature=0.8)
    finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
    if not problem and status == 200 and finished != set(range(n)):
        problem = f"choices finished {sorted(finished)} of n={n}"
    return status, problem


async def stop_strings(t: Traffic, rng: random.Random) -> tuple[int, str]:
    stop = rng.sample(STOPS, 2)
    r, problem = await _plain(t, rng, chat=False, stop=stop, max_tokens=12)
    if not problem and r.status_code == 200:
        for c in r.json()["choices"]:
            if any(s in c["text"] for s in stop):
                problem = f"stop string left in the text: {c['text']!r}"
    return r.status_code, problem


async def disconnect(t: Traffic, rng: random.Random) -> tuple[int, str]:
    chat = rng.random() < 0.5
    status, problem, _ = await _stream(t, rng, chat, read=rng.randrange(1, 3), max_tokens=24)
    return status, problem


async def abort(t: Traffic, rng: random.Random) -> tuple[int, str]:
    """Start a long stream, abort it by id from a second connection, and read the stream to its end."""
    body = t.body(rng, False, True, max_tokens=48, ignore_eos=True)
    async with t.client.stream("POST", "/v1/completions", json=body, headers=t.headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, _error_problem(r, {429, 503})
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                first = json.loads(line[6:])
                if "error" in first:  # the stream failed before it started (a worker died under chaos)
                    return 200, f"error event: {first['error']}"
                request_id = first["id"]
                break
        else:
            return 200, "stream ended before its first event"
        a = await t.client.post(f"/v1/requests/{request_id}/abort", headers=t.headers | JSON)
        problem = _error_problem(a, {200, 404})  # 404: it finished before the abort arrived
        async for line in lines:
            if line == "data: [DONE]":
                return 200, problem
    return 200, problem or "aborted stream ended without [DONE]"


async def cache_reset(t: Traffic, rng: random.Random) -> tuple[int, str]:
    r = await t.client.post("/v1/cache/reset", headers=t.headers | JSON)
    return r.status_code, _error_problem(r, {200})


async def oversize(t: Traffic, rng: random.Random) -> tuple[int, str]:
    body = {"model": t.model, "prompt": "x" * (t.max_body_bytes + 16), "max_tokens": 1}
    r = await t.client.post("/v1/completions", json=body, headers=t.headers)
    return r.status_code, _error_problem(r, {413})


def _malformed_bodies(model: str) -> list[tuple[bytes, dict[str, str]]]:
    js = JSON
    cases: list[dict] = [
        {"model": model, "prompt": "hi", "max_tokens": "many"},
        {"model": model, "prompt": 5.5},
        {"model": model, "prompt": "hi", "temperature": -3},
        {"model": model, "prompt": "hi", "n": 0},
        {"model": model, "prompt": [[1, 2], "mixed"]},
        {"model": model, "prompt": [10**12]},
        {"model": "no-such-model", "prompt": "hi"},
        {"model": model, "messages": "not a list"},
        {"model": model, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": model, "prompt": "hi", "stop": [""]},
    ]
    raw = [(json.dumps(c).encode(), js) for c in cases]
    raw += [(b'{"model": "x", "prompt": ', js), (b"\xff\xfe not json", js), (b"[]", js)]
    return raw


async def malformed(t: Traffic, rng: random.Random) -> tuple[int, str]:
    content, headers = rng.choice(_malformed_bodies(t.model))
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    r = await t.client.post(path, content=content, headers=t.headers | headers)
    return r.status_code, _error_problem(r, {400, 404, 413, 415, 422})


async def too_long(t: Traffic, rng: random.Random) -> tuple[int, str]:
    body = {"model": t.model, "prompt": t.text[:20000], "max_tokens": 4}
    r = await t.client.post("/v1/completions", json=body, headers=t.headers)
    return r.status_code, _error_problem(r, {400, 413})


# kind -> (weight, runner)
KINDS: dict[str, tuple[int, Callable[[Traffic, random.Random], Awaitable[Outcome]]]] = {
    name: (weight, _timed(name, fn))
    for name, weight, fn in [
        ("completion", 20, completion),
        ("completion_stream", 14, completion_stream),
        ("chat", 12, chat),
        ("chat_stream", 10, chat_stream),
        ("n_gt_1", 8, fan_out),
        ("stop_strings", 8, stop_strings),
        ("disconnect", 8, disconnect),
        ("abort", 5, abort),
        ("cache_reset", 2, cache_reset),
        ("oversize", 3, oversize),
        ("malformed", 8, malformed),
        ("too_long", 2, too_long),
    ]
}
LATENCY_KINDS = ("completion", "chat")  # short, complete requests: their latency percentiles are compared
