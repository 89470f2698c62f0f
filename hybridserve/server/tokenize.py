"""POST /tokenize and /detokenize (vLLM's utility endpoints)."""

from __future__ import annotations

from functools import partial

import msgspec
from pydantic import BaseModel
from starlette.responses import Response

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.server.chat_prompt import prompt_kwargs, render_messages, v4_efforts
from hybridserve.server.completions import check_ids
from hybridserve.server.errors import APIError
from hybridserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from hybridserve.server.serving import ServerSettings, check_model, check_text_fits, off_loop
from hybridserve.tokenizer import Tokenizer


def _tokenizer(llm: AsyncLLM) -> Tokenizer:
    if llm.tokenizer is None:
        raise APIError(400, "this model ships no tokenizer", code="no_tokenizer")
    return llm.tokenizer


async def tokenize(body: TokenizeRequest, llm: AsyncLLM, settings: ServerSettings) -> Response:
    check_model(body, settings, required=False)
    tokenizer = _tokenizer(llm)
    if body.messages is not None:
        extra = prompt_kwargs(body, settings, v4_efforts(llm))
        ids, _ = await render_messages(body.messages, llm, body.add_generation_prompt, **extra)
    else:
        prompt = body.prompt or ""
        check_text_fits(llm, prompt, "prompt")
        ids = await off_loop(len(prompt), partial(tokenizer.encode, prompt, body.add_special_tokens))

    def answer() -> Response:
        strs = [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        limit = llm.max_request_tokens
        return _json(TokenizeResponse(count=len(ids), max_model_len=limit, tokens=ids, token_strs=strs))

    return await off_loop(len(ids) * 4, answer)


async def detokenize(body: DetokenizeRequest, llm: AsyncLLM, settings: ServerSettings) -> Response:
    check_model(body, settings, required=False)
    tokenizer = _tokenizer(llm)

    def answer() -> Response:
        check_ids(body.tokens, llm.vocab_size, "tokens")
        # special tokens kept: a rendered chat prompt comes back whole (vLLM's /detokenize keeps them too)
        text = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return _json(DetokenizeResponse(prompt=text))

    return await off_loop(len(body.tokens) * 4, answer)


def _json(out: BaseModel) -> Response:
    """msgspec encodes a 1M-id answer in ~5 ms; json.dumps (JSONResponse) holds the GIL ~60 ms for it."""
    return Response(msgspec.json.encode(out.__dict__), media_type="application/json")
