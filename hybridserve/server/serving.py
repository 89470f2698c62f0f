"""What both endpoints share: settings, sampling defaults, request fan-out, admission, usage."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.request import Logprob, Request, RequestOutput, RequestOutputKind, SamplingParams
from hybridserve.server.constraints import structured_outputs
from hybridserve.server.errors import APIError
from hybridserve.server.gc_pause import gc_paused
from hybridserve.server.kv_transfer_params import apply_kv_transfer
from hybridserve.server.protocol import (
    MAX_LOGPROBS,
    PromptLogprob,
    PromptTokensDetails,
    Usage,
    _SamplingFields,
)
from hybridserve.server.streams import merge, unless_disconnected


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    model_aliases: list[str] = field(default_factory=list)  # more names the model answers to
    chat_template: str | None = None  # instead of the checkpoint's (--chat-template)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under the request's
    reasoning_parser: str | None = None  # --reasoning-parser: split reasoning from content
    tool_call_parser: str | None = None  # --tool-call-parser; None: the tokenizer mode's own
    enable_auto_tool_choice: bool = False  # with a named parser: read calls when tool_choice is auto
    max_logprobs: int = MAX_LOGPROBS  # most logprobs / top_logprobs / prompt_logprobs (--max-logprobs)


T = TypeVar("T")

# Inputs longer than this (characters or token ids) are tokenised / rendered in a worker thread, so
# that one large request never stalls the event loop; short ones stay inline (a thread hop costs ~50us).
OFF_LOOP_CHARS = 16_384

_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: str) -> dict[str, Any]:
    """Sampling defaults the checkpoint recommends (``generation_config.json``), as vLLM applies them."""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in _DEFAULTABLE if cfg.get(k) is not None}


def sampling_params(
    body: _SamplingFields, settings: ServerSettings, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name)
        return value if value is not None else settings.generation_defaults.get(name, fallback)

    _check_logprobs(settings, logprobs, "logprobs")
    _check_logprobs(settings, body.prompt_logprobs, "prompt_logprobs")
    try:
        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
            prompt_logprobs=body.prompt_logprobs,
            structured_outputs=structured_outputs(body),
            # a stream reads only each step's new tokens; a whole answer waits for the final output
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _check_logprobs(settings: ServerSettings, n: int | None, param: str) -> None:
    if n is not None and n > settings.max_logprobs:
        raise APIError(
            400,
            f"{param} is {n} but this server returns at most {settings.max_logprobs} (--max-logprobs)",
            param=param,
            code="invalid_value",
        )


def check_model(body: Any, settings: ServerSettings, required: bool = True) -> None:
    """404 ``model_not_found`` for a model this server does not serve, as OpenAI and vLLM answer."""
    if body.model is None and not required:
        return
    if body.model != settings.model_name and body.model not in settings.model_aliases:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


def new_id(prefix: str) -> str:
    """An API id: 128 random bits, so only its holder can name it (e.g. to abort it)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def api_id(request_id: str) -> str:
    """The API id an engine request id belongs to (``{api id}-{prompt}-{choice}``)."""
    return request_id.rsplit("-", 2)[0]


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """Run ``work`` inline when the input is small, else in a worker thread, with no garbage collection
    meanwhile (a full one would hold the GIL, and so the loop, for 0.1 s or more)."""
    return work() if size <= OFF_LOOP_CHARS else await asyncio.to_thread(_without_collecting, work)


def _without_collecting(work: Callable[[], T]) -> T:
    with gc_paused():
        return work()


def response_size(finals: list[RequestOutput]) -> int:
    """About how many objects a final response is built from (logprob entries dominate), to weigh it
    against OFF_LOOP_CHARS: 4,096 prompt tokens with 20 logprobs each take ~1.5 s to build and encode."""
    entries = sum(len(o.prompt_logprobs or ()) + len(o.outputs[0].logprobs or ()) for o in finals)
    return entries * 21 + sum(len(o.outputs[0].text) for o in finals)


def json_response(model: BaseModel) -> Response:
    """pydantic's own encoder: ~3x faster than json.dumps for a large answer (non-finite numbers: null)."""
    return Response(model.model_dump_json(), media_type="application/json")


def check_text_fits(llm: AsyncLLM, text: str, param: str) -> None:
    """400 for text that cannot fit in a request whatever it tokenises to, before tokenising it."""
    assert llm.tokenizer is not None
    least, limit = llm.tokenizer.min_num_tokens(text), llm.max_request_tokens
    if least > limit:
        raise APIError(
            400,
            f"{param} is {len(text):,} characters, at least {least:,} tokens, but this server holds at most "
            f"{limit:,} tokens per request",
            param=param,
            code="context_length_exceeded",
        )


def fan_out(
    base_id: str, prompts: list[list[int]], params: SamplingParams, n: int, texts: list[str | None]
) -> list[Request]:
    """One engine request per (prompt, choice); choices of one prompt get consecutive seeds."""
    requests = []
    for i, (ids, text) in enumerate(zip(prompts, texts, strict=True)):
        for j in range(n):
            p = params if params.seed is None or j == 0 else _with_seed(params, params.seed + j)
            requests.append(Request(f"{base_id}-{i}-{j}", list(ids), p, prompt=text))
    return requests


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def check_fan_out(num_sequences: int, settings: ServerSettings) -> None:
    """400 for a request that fans out (prompts x n) beyond what the queue can ever hold."""
    if num_sequences > settings.max_queue:
        raise APIError(
            400,
            f"this request fans out to {num_sequences} sequences (prompts x n) but the server queues at "
            f"most {settings.max_queue}; send fewer prompts or a smaller n",
            param="n",
            code="too_many_sequences",
        )


def _admit(llm: AsyncLLM, settings: ServerSettings, requests: list[Request]) -> None:
    """Refuse what can never run (400) and what the queue has no room for (429)."""
    for r in requests:
        try:
            llm.check(r)
        except RequestRejected as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
    check_fan_out(len(requests), settings)
    if llm.num_waiting + len(requests) > settings.max_queue:
        raise APIError(
            429,
            f"the server is at capacity ({llm.num_waiting} requests waiting, limit "
            f"{settings.max_queue}); retry later",
            code="queue_full",
            headers={"Retry-After": str(settings.retry_after_s)},
        )


async def start(
    llm: AsyncLLM,
    settings: ServerSettings,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    texts: list[str | None],
    body: _SamplingFields | None = None,
) -> tuple[list[Request], AsyncIterator[tuple[int, RequestOutput]]]:
    """Fan out, admit (400 / 429) and queue every request, with no await between the admission check
    and the queueing that could let another handler in; -> (requests, their merged outputs)."""
    requests = fan_out(base_id, prompts, params, n, texts)
    if body is not None:
        apply_kv_transfer(requests, body.kv_transfer_params, body.stream)
    _admit(llm, settings, requests)
    return requests, merge([await llm.submit(r) for r in requests])


async def final_outputs(
    raw: HTTPRequest, outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
) -> list[RequestOutput] | None:
    """The last output of each of ``n`` requests, in order; None if the client disconnected first."""

    async def collect() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(n)]

    try:
        return await unless_disconnected(raw, collect)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


def usage(prompts: list[list[int]], finals: list[RequestOutput], n: int) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(o.num_output_tokens for o in finals)
    cached = sum(finals[i * n].num_cached_tokens for i in range(len(prompts)) if i * n < len(finals))
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: logprob, rank, text}."""
    if entries is None:
        return None

    def entry(e: dict[int, Logprob]) -> dict[str, PromptLogprob]:
        return {
            str(t): PromptLogprob(logprob=p.logprob, rank=p.rank, decoded_token=p.decoded_token)
            for t, p in e.items()
        }

    return [None if e is None else entry(e) for e in entries]
