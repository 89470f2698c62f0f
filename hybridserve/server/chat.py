"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import Request, RequestOutput, SampleLogprobs
from hybridserve.server.disagg import prefill_answer
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
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
    sampling_params,
    start,
    usage,
)
from hybridserve.server.streams import guarded, sse
from hybridserve.tokenizer import Tokenizer


async def _prompt(body: ChatCompletionRequest, llm: AsyncLLM) -> tuple[list[int], str]:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so chat is unavailable: use /v1/completions")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    content = "".join(m["content"] for m in messages)
    check_text_fits(llm, content, "messages")
    try:
        return await off_loop(
            len(content), partial(tokenizer.encode_chat, messages, body.add_generation_prompt)
        )
    except ValueError as exc:  # the template's raise_exception, or text the template cannot escape
        raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from exc


def _unsupported(body: ChatCompletionRequest) -> None:
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(
            400,
            f"response_format {body.response_format.type!r} is not supported yet",
            param="response_format",
        )
    if body.tools:
        raise APIError(400, "tools are not supported yet", param="tools")


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
    _unsupported(body)
    ids, text = await _prompt(body, llm)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs or 0
    params = sampling_params(body, settings, max_tokens, top if body.logprobs else None)
    base = new_id("chatcmpl")
    requests, outputs = await start(llm, settings, base, [ids], params, body.n, [text], body)
    if body.stream:
        return StreamingResponse(
            guarded(_stream(body, base, ids, requests, outputs, llm, top)), media_type="text/event-stream"
        )

    finals = await final_outputs(raw, outputs, len(requests))
    if finals is None:
        return Response(status_code=499)  # the client went away; its requests were aborted
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=o.outputs[0].text),
            finish_reason=o.outputs[0].finish_reason,
            stop_reason=o.outputs[0].stop_reason,
            logprobs=_logprobs(o.outputs[0].logprobs, o.outputs[0].token_ids, llm.tokenizer, top),
        )
        for i, o in enumerate(finals)
    ]
    response = ChatCompletionResponse(
        id=base, model=settings.model_name, choices=choices, usage=usage([ids], finals, body.n)
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
    async for i, out in outputs:
        c = out.outputs[0]
        if out.finished:
            finals[i] = out
        if not out.new_text and not out.finished and not (body.logprobs and out.new_token_ids):
            continue
        entries = c.logprobs[-len(out.new_token_ids) :] if c.logprobs and out.new_token_ids else None
        choice = ChatChunkChoice(
            index=i,
            delta=DeltaMessage(content=out.new_text or None),
            logprobs=_logprobs(entries, out.new_token_ids, llm.tokenizer, top),
            finish_reason=c.finish_reason,
        )
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[choice]))
    if body.stream_options and body.stream_options.include_usage:
        ordered = [finals[i] for i in range(len(requests))]
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[], usage=usage([ids], ordered, body.n)))
    yield sse("[DONE]")
