"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.chat_format.dsml import THINK
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import Request, RequestOutput, SampleLogprobs, SamplingParams
from hybridserve.server.chat_prompt import prompt_kwargs, render_messages, v4_efforts
from hybridserve.server.constraints import checked
from hybridserve.server.errors import APIError
from hybridserve.server.kv_transfer_params import decode_answer, decode_comment, prefill_answer
from hybridserve.server.output_parsers import (
    STRUCTURAL_TAGS,
    ChatOutputParser,
    OutputReading,
    reads_tools,
    tool_parser_name,
)
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
    final_outputs,
    json_response,
    new_id,
    off_loop,
    prompt_logprobs_json,
    response_size,
    sampling_params,
    start,
    usage,
)
from hybridserve.server.streams import guarded, sse
from hybridserve.server.tool_calls import tool_constraint
from hybridserve.tokenizer import Tokenizer


async def render_prompt(
    body: ChatCompletionRequest, llm: AsyncLLM, settings: ServerSettings
) -> tuple[list[int], str]:
    """(token ids, text) of the request's prompt in the model's conversation format."""
    extra = prompt_kwargs(body, settings, v4_efforts(llm))
    return await render_messages(body.messages, llm, body.add_generation_prompt, **extra)


def output_reading(
    body: ChatCompletionRequest, llm: AsyncLLM, settings: ServerSettings, prompt: str
) -> OutputReading:
    """How the answer to ``prompt`` is read: for reasoning (--reasoning-parser), for tool calls (which)."""
    mode = llm.tokenizer.mode if llm.tokenizer is not None else "hf"
    parser = tool_parser_name(settings, mode) if reads_tools(body, settings) else None
    return OutputReading(prompt, settings.reasoning_parser is not None, parser)


def with_tool_constraint(
    body: ChatCompletionRequest, params: SamplingParams, reading: OutputReading
) -> SamplingParams:
    """``params`` with the grammar of the tool calls the request forces (or, in DSML, allows)."""
    if reading.tool_parser is None:
        return params
    dsml = reading.tool_parser == "deepseek_v4"
    thinking = dsml and reading.prompt.endswith(THINK)
    auto = dsml and params.structured_outputs is None  # a call begun is held to the schema
    forced = tool_constraint(body, STRUCTURAL_TAGS[reading.tool_parser], thinking, auto)
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
    reading: OutputReading, text: str, finish: str | None
) -> tuple[ChatResponseMessage, str | None]:
    """The response message: reasoning and tool calls parsed out when the request reads them."""
    reasoning, content, calls = reading.whole(text)
    message = ChatResponseMessage(
        content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls
    )
    return message, "tool_calls" if calls and finish == "stop" else finish


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
    ids, text = await render_prompt(body, llm, settings)
    reading = output_reading(body, llm, settings, text)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs or 0
    params = with_tool_constraint(
        body, sampling_params(body, settings, max_tokens, top if body.logprobs else None), reading
    )
    base = new_id("chatcmpl")
    requests, outputs = await start(llm, settings, base, [ids], params, body.n, [text], body)
    if body.stream:
        return StreamingResponse(
            guarded(_stream(body, base, ids, requests, outputs, llm, top, reading)),
            media_type="text/event-stream",
        )

    finals = await final_outputs(raw, outputs, len(requests))
    if finals is None:
        return Response(status_code=499)  # the client went away; its requests were aborted

    def build() -> ChatCompletionResponse:
        choices = []
        for i, o in enumerate(finals):
            c = o.outputs[0]
            message, finish = _message_of(reading, c.text, c.finish_reason)
            lp = _logprobs(c.logprobs, c.token_ids, llm.tokenizer, top)
            choices.append(
                ChatChoice(
                    index=i, message=message, finish_reason=finish, stop_reason=c.stop_reason, logprobs=lp
                )
            )
        return ChatCompletionResponse(
            id=base,
            model=settings.model_name,
            choices=choices,
            usage=usage([ids], finals, body.n),
            prompt_logprobs=prompt_logprobs_json(finals[0].prompt_logprobs) if finals else None,
        )

    response = await off_loop(response_size(finals), build)  # 20 logprobs a token take long to build
    if requests[0].remote_decode:
        response.kv_transfer_params = prefill_answer(finals)
    elif requests[0].remote_prefill is not None:
        response.kv_transfer_params = decode_answer(finals)
    return await off_loop(response_size(finals), partial(json_response, response))


async def _stream(
    body: ChatCompletionRequest,
    base: str,
    ids: list[int],
    requests: list[Request],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    llm: AsyncLLM,
    top: int,
    reading: OutputReading,
) -> AsyncIterator[str]:
    model = body.model
    for i in range(len(requests)):
        first = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[first]))
    finals: dict[int, RequestOutput] = {}
    parsers = [reading.stream_parser() for _ in requests]
    async for i, out in outputs:
        c = out.outputs[0]
        if out.finished:
            finals[i] = out
        if not out.new_text and not out.finished and not (body.logprobs and out.new_token_ids):
            continue
        logprobs = _logprobs(out.new_logprobs or None, out.new_token_ids, llm.tokenizer, top)
        for delta, finish in _deltas(parsers[i], out.new_text, c.finish_reason):
            choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
            yield sse(ChatCompletionChunk(id=base, model=model, choices=[choice]))
            logprobs = None
    if body.stream_options and body.stream_options.include_usage:
        ordered = [finals[i] for i in range(len(requests))]
        yield sse(ChatCompletionChunk(id=base, model=model, choices=[], usage=usage([ids], ordered, body.n)))
    if comment := decode_comment(list(finals.values())):
        yield comment
    yield sse("[DONE]")


def _deltas(parser: ChatOutputParser, text: str, finish: str | None) -> list[tuple[DeltaMessage, str | None]]:
    """One step's deltas: the reasoning first, then the answer (content, tool calls) in a chunk of its own."""
    reasoning, content, calls = parser.feed(text, final=finish is not None)
    finish = "tool_calls" if finish == "stop" and parser.made_calls else finish
    answer = DeltaMessage(content=content or None, tool_calls=calls or None)
    if not reasoning:
        return [(answer, finish)]
    thought = DeltaMessage(reasoning_content=reasoning, reasoning=reasoning)
    if not (content or calls or finish):
        return [(thought, None)]
    return [(thought, None), (answer, finish)]
