"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import Request, RequestOutput, SampleLogprobs, SamplingParams
from hybridserve.server.constraints import checked
from hybridserve.server.errors import APIError
from hybridserve.server.kv_transfer_params import prefill_answer
from hybridserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
)
from hybridserve.server.serving import (
    ServerSettings,
    check_model,
    check_text_fits,
    final_outputs,
    new_id,
    off_loop,
    prompt_logprobs_json,
    sampling_params,
    start,
    usage,
)
from hybridserve.server.streams import guarded, sse
from hybridserve.server.tool_calls import StreamingToolParser, parse_tool_calls, parses_tools, tool_constraint
from hybridserve.tokenizer import Tokenizer


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (``developer`` is ``system``; tool calls as dicts)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    out.update({k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None})
    return out


async def render_messages(
    messages: list[ChatMessage], llm: AsyncLLM, add_generation_prompt: bool, **extra: Any
) -> tuple[list[int], str]:
    """Token ids and text of the conversation in the chat template; 400 when it cannot be rendered."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable: use /v1/completions")
    rendered = [_message(m) for m in messages]
    content = "".join(m["content"] for m in rendered)
    check_text_fits(llm, content, "messages")
    try:
        return await off_loop(
            len(content), partial(tokenizer.encode_chat, rendered, add_generation_prompt, **extra)
        )
    except Exception as exc:  # the template's raise_exception, text it cannot escape, or a template bug
        raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from exc


async def _prompt(body: ChatCompletionRequest, llm: AsyncLLM) -> tuple[list[int], str]:
    extra = dict(body.chat_template_kwargs or {})
    if body.tools:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return await render_messages(body.messages, llm, body.add_generation_prompt, **extra)


def _with_tool_constraint(body: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
    forced = tool_constraint(body)
    if forced is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(
            400,
            "tool_choice required or named cannot be combined with another output constraint",
            param="tool_choice",
        )
    return replace(params, structured_outputs=checked(forced, "tools"))


def _message_of(
    body: ChatCompletionRequest, text: str, finish: str | None
) -> tuple[ChatResponseMessage, str | None]:
    """The response message, with tool calls parsed out when the request reads them."""
    if not parses_tools(body):
        return ChatResponseMessage(content=text), finish
    content, calls = parse_tool_calls(text)
    return ChatResponseMessage(
        content=content, tool_calls=calls
    ), "tool_calls" if calls and finish == "stop" else finish


def _logprobs(
    entries: SampleLogprobs | None, token_ids: list[int], tokenizer: Tokenizer | None, top: int
) -> ChatLogprobs | None:
    if entries is None:
        return None

    def text(tid: int, decoded: str | None) -> str:
        return decoded or (tokenizer.token_text(tid) if tokenizer else str(tid))

    content = []
    for tok, entry in zip(token_ids, entries, strict=False):
        chosen = text(tok, entry[tok].decoded_token)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        tops = [
            TopLogprob(
                token=text(t, lp.decoded_token),
                logprob=lp.logprob,
                bytes=list(text(t, lp.decoded_token).encode()),
            )
            for t, lp in ranked
        ]
        content.append(
            TokenLogprob(
                token=chosen, logprob=entry[tok].logprob, bytes=list(chosen.encode()), top_logprobs=tops
            )
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(
    body: ChatCompletionRequest, raw: HTTPRequest, llm: AsyncLLM, settings: ServerSettings
) -> Response:
    check_model(body, settings)
    ids, text = await _prompt(body, llm)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs or 0
    params = _with_tool_constraint(
        body, sampling_params(body, settings, max_tokens, top if body.logprobs else None)
    )
    base = new_id("chatcmpl")
    requests, outputs = await start(llm, settings, base, [ids], params, body.n, [text], body)
    if body.stream:
        return StreamingResponse(
            guarded(_stream(body, base, ids, requests, outputs, llm, top)), media_type="text/event-stream"
        )

    finals = await final_outputs(raw, outputs, len(requests))
    if finals is None:
        return Response(status_code=499)  # the client went away; its requests were aborted
    choices = []
    for i, o in enumerate(finals):
        message, finish = _message_of(body, o.outputs[0].text, o.outputs[0].finish_reason)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                finish_reason=finish,
                stop_reason=o.outputs[0].stop_reason,
                logprobs=_logprobs(o.outputs[0].logprobs, o.outputs[0].token_ids, llm.tokenizer, top),
            )
        )
    response = ChatCompletionResponse(
        id=base,
        model=settings.model_name,
        choices=choices,
        usage=usage([ids], finals, body.n),
        prompt_logprobs=prompt_logprobs_json(finals[0].prompt_logprobs) if finals else None,
    )
    if requests[0].remote_decode:
        response.kv_transfer_params = prefill_answer(finals)
    return JSONResponse(response.model_dump())


async def _stream(
    body: ChatCompletionRequest,
    base: str,
    ids: list[int],
    requests: list[Request],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    llm: AsyncLLM,
    top: int,
) -> AsyncIterator[str]:
    model = body.model
    for i in range(len(requests)):
        first = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[first]))
    finals: dict[int, RequestOutput] = {}
    parsers = [StreamingToolParser() if parses_tools(body) else None for _ in requests]
    async for i, out in outputs:
        c = out.outputs[0]
        if out.finished:
            finals[i] = out
        if not out.new_text and not out.finished and not (body.logprobs and out.new_token_ids):
            continue
        delta, finish = _delta(parsers[i], out.new_text, c.finish_reason)
        choice = ChatChunkChoice(
            index=i,
            delta=delta,
            logprobs=_logprobs(out.new_logprobs or None, out.new_token_ids, llm.tokenizer, top),
            finish_reason=finish,
        )
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[choice]))
    if body.stream_options and body.stream_options.include_usage:
        ordered = [finals[i] for i in range(len(requests))]
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[], usage=usage([ids], ordered, body.n)))
    yield sse("[DONE]")


def _delta(
    parser: StreamingToolParser | None, text: str, finish: str | None
) -> tuple[DeltaMessage, str | None]:
    if parser is None:
        return DeltaMessage(content=text or None), finish
    content, calls = parser.feed(text, final=finish is not None)
    finish = "tool_calls" if finish == "stop" and parser.calls else finish
    return DeltaMessage(content=content or None, tool_calls=calls or None), finish
