"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.request import RequestOutput, SampleLogprobs
from hybridserve.server.errors import APIError
from hybridserve.server.kv_transfer_params import decode_answer, decode_comment, prefill_answer
from hybridserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from hybridserve.server.serving import (
    ServerSettings,
    check_fan_out,
    check_model,
    check_text_fits,
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
from hybridserve.tokenizer import Tokenizer


def _items(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def check_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise APIError(
            400, f"{param} token ids must be in [0, {vocab_size})", param=param, code="invalid_prompt"
        )


def checked_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """A copy of ``ids``, once they are all in the vocabulary."""
    check_ids(ids, vocab_size, param)
    return list(ids)


async def _prompts(
    body: CompletionRequest, llm: AsyncLLM, settings: ServerSettings
) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and text of each prompt; counts and ids are checked before anything (de)codes them."""
    tokenizer = llm.tokenizer
    ids: list[list[int]] = []
    texts: list[str | None] = []
    items = _items(body)
    check_fan_out(len(items) * body.n, settings)
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            check_text_fits(llm, item, "prompt")
            ids.append(await off_loop(len(item), partial(tokenizer.encode, item)))
            texts.append(item)
        else:
            ids.append(await off_loop(len(item) * 4, partial(checked_ids, item, llm.vocab_size)))
            decode = partial(tokenizer.decode, ids[-1]) if tokenizer is not None else None
            texts.append(await off_loop(len(item) * 4, decode) if decode is not None else None)
    return ids, texts


def _unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")


def _logprobs(
    entries: SampleLogprobs | None, token_ids: list[int], tokenizer: Tokenizer | None, offset: int
) -> CompletionLogprobs | None:
    if entries is None:
        return None
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries, strict=False):
        text = entry[tok].decoded_token or (tokenizer.token_text(tok) if tokenizer else str(tok))
        out.tokens.append(text)
        out.token_logprobs.append(entry[tok].logprob)
        out.top_logprobs.append({(lp.decoded_token or str(t)): lp.logprob for t, lp in entry.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _prompt_logprobs(out: RequestOutput, tokenizer: Tokenizer | None) -> CompletionLogprobs:
    """The echoed prompt's tokens with their logprobs (the first token has none)."""
    assert out.prompt_logprobs is not None
    first = out.prompt_token_ids[0]
    head = CompletionLogprobs(
        tokens=[tokenizer.token_text(first) if tokenizer else str(first)],
        token_logprobs=[None],
        top_logprobs=[None],
        text_offset=[0],
    )
    entries = [e for e in out.prompt_logprobs[1:] if e is not None]
    rest = _logprobs(entries, out.prompt_token_ids[1:], tokenizer, len(head.tokens[0]))
    return _joined(head, rest) if rest is not None else head


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


async def create_completion(
    body: CompletionRequest, raw: HTTPRequest, llm: AsyncLLM, settings: ServerSettings
) -> Response:
    check_model(body, settings)
    _unsupported(body)
    prompts, texts = await _prompts(body, llm, settings)
    params = sampling_params(body, settings, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None and not body.stream:  # the echoed prompt gets logprobs too
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, body.logprobs))
    base = new_id("cmpl")
    requests, outputs = await start(llm, settings, base, prompts, params, body.n, texts, body)
    if body.stream:
        return StreamingResponse(
            guarded(_stream(body, base, prompts, texts, requests, outputs, llm)),
            media_type="text/event-stream",
        )

    finals = await final_outputs(raw, outputs, len(requests))
    if finals is None:
        return Response(status_code=499)  # the client went away; its requests were aborted
    build = partial(_response, body, base, settings.model_name, prompts, texts, finals, llm.tokenizer)
    response = await off_loop(response_size(finals), build)
    if requests[0].remote_decode:
        response.kv_transfer_params = prefill_answer(finals)
    elif requests[0].remote_prefill is not None:
        response.kv_transfer_params = decode_answer(finals)
    return await off_loop(response_size(finals), partial(json_response, response))


def _response(
    body: CompletionRequest,
    base: str,
    model: str,
    prompts: list[list[int]],
    texts: list[str | None],
    finals: list[RequestOutput],
    tokenizer: Tokenizer | None,
) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        c = out.outputs[0]
        echo = (texts[i // body.n] or "") if body.echo else ""
        lp = _logprobs(c.logprobs, c.token_ids, tokenizer, len(echo))
        if echo and lp is not None and out.prompt_logprobs is not None:
            lp = _joined(_prompt_logprobs(out, tokenizer), lp)
        choices.append(
            CompletionChoice(
                index=i,
                text=echo + c.text,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=lp,
                prompt_logprobs=prompt_logprobs_json(
                    out.prompt_logprobs if body.prompt_logprobs is not None else None
                ),
            )
        )
    return CompletionResponse(id=base, model=model, choices=choices, usage=usage(prompts, finals, body.n))


async def _stream(
    body: CompletionRequest,
    base: str,
    prompts: list[list[int]],
    texts: list[str | None],
    requests: list,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    llm: AsyncLLM,
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    offsets = [0] * len(requests)
    model = body.model
    if body.echo:
        for i in range(len(requests)):
            echo = texts[i // body.n] or ""
            offsets[i] = len(echo)
            yield sse(
                CompletionResponse(id=base, model=model, choices=[CompletionChoice(index=i, text=echo)])
            )
    async for i, out in outputs:
        c = out.outputs[0]
        if out.finished:
            finals[i] = out
        if not out.new_text and not out.finished and not (body.logprobs is not None and out.new_token_ids):
            continue
        lp = _logprobs(out.new_logprobs or None, out.new_token_ids, llm.tokenizer, offsets[i])
        offsets[i] += len(out.new_text)
        choice = CompletionChoice(
            index=i, text=out.new_text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        )
        yield sse(CompletionResponse(id=base, model=model, choices=[choice]))
    if body.stream_options and body.stream_options.include_usage:
        ordered = [finals[i] for i in range(len(requests))]
        yield sse(CompletionResponse(id=base, model=model, choices=[], usage=usage(prompts, ordered, body.n)))
    if comment := decode_comment(list(finals.values())):
        yield comment
    yield sse("[DONE]")
