"""One streamed request to an OpenAI-compatible endpoint, timed token by token."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    text: str = ""
    error: str = ""
    start: float = 0.0

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class Endpoint:
    base_url: str
    model: str
    kind: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    extra: dict = field(default_factory=dict)  # engine-specific request fields

    @property
    def url(self) -> str:
        path = "chat/completions" if self.kind == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/v1/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _body(ep: Endpoint, prompt: str | list[int], messages: list[dict[str, str]], max_tokens: int) -> dict:
    body: dict = {
        "model": ep.model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ep.ignore_eos:
        body["ignore_eos"] = True
    body.update(ep.extra)
    if ep.kind == "chat":
        body["messages"] = messages or [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(ep: Endpoint, chunk: dict) -> str:
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    if ep.kind == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send(
    client: httpx.AsyncClient,
    ep: Endpoint,
    prompt: str | list[int],
    max_tokens: int,
    messages: list[dict[str, str]] | None = None,
    prompt_len: int = 0,
) -> RequestResult:
    """Stream one request; TTFT is the first chunk with text, ITL the gaps between later chunks."""
    res = RequestResult(ok=False, prompt_len=prompt_len, start=time.perf_counter())
    last = res.start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream(
            "POST", ep.url, json=_body(ep, prompt, messages or [], max_tokens), headers=ep.headers()
        ) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    res.prompt_len = chunk["usage"].get("prompt_tokens", res.prompt_len)
                text = _chunk_text(ep, chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                res.text += text
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - res.start
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = "no tokens in the response"
    return res
