"""Streamed logprobs when the stream is read behind the engine: each chunk carries its own tokens'."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, Logprob, Request, RequestOutput, SamplingParams
from hybridserve.server import chat, completions
from hybridserve.server.output_parsers import OutputReading
from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest

STEPS = [[11], [13, 14], [17]]


def _outputs_read_late() -> list[RequestOutput]:
    """Every step processed before any output is read (the engine ran ahead of the HTTP writer)."""
    processor = OutputProcessor(None)
    processor.add_request(Request("r", [5, 6, 7], SamplingParams(logprobs=1, max_tokens=4)))
    outs = []
    for n, ids in enumerate(STEPS):
        entries = [{t: Logprob(-0.25 * t, 1), t + 100: Logprob(-9.0, 2)} for t in ids]
        finish = FinishReason.LENGTH if n == len(STEPS) - 1 else None
        outs += processor.process([EngineCoreOutput("r", ids, entries, finish)])[0]
    return outs


async def _feed(outs: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    for out in outs:
        yield 0, out


def _chunks(stream: AsyncIterator[str]) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        return [s async for s in stream]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(collect())]
    return [json.loads(e) for e in events if e and e != "[DONE]"]


def test_chat_stream_logprobs_follow_their_tokens() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest(model="m", messages=messages, logprobs=True, stream=True)  # type: ignore[arg-type]
    llm = SimpleNamespace(tokenizer=None)
    reading = OutputReading("", reasoning=False, tool_parser=None)
    stream = chat._stream(body, "id", [1], [None], _feed(_outputs_read_late()), llm, 1, reading)  # type: ignore[arg-type]
    content = [c["choices"][0]["logprobs"]["content"] for c in _chunks(stream) if c["choices"][0]["logprobs"]]
    assert [[e["token"] for e in chunk] for chunk in content] == [[str(t) for t in ids] for ids in STEPS]
    assert [e["logprob"] for chunk in content for e in chunk] == [-0.25 * t for ids in STEPS for t in ids]


def test_completion_stream_logprobs_follow_their_tokens() -> None:
    body = CompletionRequest(model="m", prompt="hi", logprobs=1, stream=True)
    llm = SimpleNamespace(tokenizer=None)
    stream = completions._stream(body, "id", [[5, 6, 7]], [None], [None], _feed(_outputs_read_late()), llm)  # type: ignore[arg-type]
    chunks = [c["choices"][0] for c in _chunks(stream) if c["choices"]]
    lps = [choice["logprobs"] for choice in chunks if choice["logprobs"]]
    assert [lp["tokens"] for lp in lps] == [[str(t) for t in ids] for ids in STEPS]
    assert [x for lp in lps for x in lp["token_logprobs"]] == [-0.25 * t for ids in STEPS for t in ids]
