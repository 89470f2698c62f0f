"""The transformers peer: what a user would try first to serve a DeepSeek-V4 checkpoint on CPU.

Two backends:

``--backend serve`` (default) runs ``transformers serve MODEL`` (transformers 5.23.0 CLI). Checked on
this CPU machine with a local DeepSeek-V4 folder: it serves ``/v1/chat/completions`` and
``/v1/completions``, streaming and not, one request at a time (``model.generate`` on one inference
thread; ``--continuous-batching`` rejects this model: ``ValueError: Invalid layer type:
compressed_sparse_attention``). What it needed and lacks:

* ``pip install "transformers[serving]"`` (openai, rich, ...) and ``accelerate``; without the extras:
  ``ImportError: Missing dependencies for serving. Install with `pip install transformers[serving]```;
  without accelerate: ``ValueError: Using a `device_map` ... requires `accelerate```.
* ``/v1/models`` answers 500 (``huggingface_hub.errors.CacheNotFound: Cache directory not found``)
  unless ``HF_HUB_CACHE`` names an existing folder; even then it lists ``[]`` (local folders are not
  listed). This launcher points ``HF_HUB_CACHE`` at an empty folder so the endpoint answers.
* The model id in requests must be the folder path exactly as passed (``MODEL``); others are refused
  (``Server is pinned to 'MODEL'; requested ...``).
* ``ignore_eos`` is refused (``Unexpected fields in the request: {'ignore_eos'}``); send
  ``"generation_config": "{\\"min_new_tokens\\": N}"`` instead (it replaces the model's generation
  config; ``max_tokens`` and ``temperature`` still apply on top). ``stream_options`` is ignored on
  ``/v1/completions``; chat streams carry usage in their last chunk regardless.

``--backend wrapper`` is a minimal FastAPI/uvicorn OpenAI-compatible server over ``model.generate``,
for what ``transformers serve`` lacks: ``/v1/models`` lists the model, ``ignore_eos`` (generation
does not stop at EOS), ``stream_options.include_usage``, and one SSE event per generated token
(``TextIteratorStreamer`` subclass; the stock one emits whole words). Requests run ONE AT A TIME
(an asyncio lock): transformers' continuous batching rejects this model and its padded batching is
wrong for CSA/HCA layers (the compressors take no padding mask). Greedy when temperature is 0.
Chat prompts use the checkpoint's chat template via ``AutoTokenizer.apply_chat_template``.

    python benchmarks/peers/transformers_server.py --model PATH --port N [--backend serve|wrapper]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' string annotations here

ROOT = Path(__file__).resolve().parent.parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="DeepSeek-V4 checkpoint folder (save_pretrained layout)")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--backend", choices=["serve", "wrapper"], default="serve")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--served-model-name", default=None, help="wrapper: model id (default: --model as given)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


# --------------------------------------------------------------------------- transformers serve


def exec_transformers_serve(args: argparse.Namespace) -> None:
    exe = Path(sys.executable).parent / "transformers"
    if not exe.exists():
        raise SystemExit(f"{exe} not found: install transformers[serving] here (setup_transformers.sh)")
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    cache = Path(env.get("HF_HUB_CACHE") or ROOT / "data" / "hf-cache")
    cache.mkdir(parents=True, exist_ok=True)  # /v1/models answers 500 when the hub cache folder is missing
    env["HF_HUB_CACHE"] = str(cache)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        str(exe),
        "serve",
        args.model,
        "--device",
        "cpu",
        "--dtype",
        args.dtype,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--log-level",
        args.log_level,
    ]
    print(f"exec: {' '.join(cmd)}  (model id in requests: {args.model!r})", file=sys.stderr, flush=True)
    os.execve(str(exe), cmd, env)


# --------------------------------------------------------------------------- wrapper


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def build_app(args: argparse.Namespace) -> Any:
    import torch
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        StoppingCriteria,
        StoppingCriteriaList,
        TextIteratorStreamer,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype: Any = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    model_id = args.served_model_name or args.model
    lock = asyncio.Lock()

    class TokenStreamer(TextIteratorStreamer):
        """One queue item per generated token: ``(1, text_delta)``; the delta is '' while a UTF-8
        character is incomplete. The stock streamer holds text back until a word ends."""

        def put(self, value: Any) -> None:
            if value.dim() > 1:
                value = value[0]
            if self.skip_prompt and self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            for token in value.tolist():
                self.token_cache.append(token)
                text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
                delta = ""
                if not text.endswith("\ufffd"):
                    delta, self.print_len = text[self.print_len :], len(text)
                self.text_queue.put((1, delta), timeout=self.timeout)

        def end(self) -> None:
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs) if self.token_cache else ""
            if len(text) > self.print_len:
                self.text_queue.put((0, text[self.print_len :]), timeout=self.timeout)
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    class Cancel(StoppingCriteria):
        def __init__(self) -> None:
            self.event = threading.Event()

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)

    def number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
        value = body.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
            raise ApiError(400, f"'{key}' must be a number in [{lo}, {hi}]")
        return float(value)

    def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list")
            for m in messages:
                if isinstance(m.get("content"), list):  # content parts: keep the text ones
                    m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)")

    def max_key(body: dict[str, Any], chat: bool) -> str:
        new = chat and body.get("max_completion_tokens") is not None
        return "max_completion_tokens" if new else "max_tokens"

    def gen_kwargs(body: dict[str, Any], n_prompt: int, chat: bool) -> dict[str, Any]:
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported")
        max_tokens = int(number(body, max_key(body, chat), 16 if not chat else 256, 1, 1 << 20))
        limit = getattr(model.config, "max_position_embeddings", 1 << 30)
        if n_prompt + max_tokens > limit:
            raise ApiError(400, f"prompt ({n_prompt}) + max_tokens ({max_tokens}) exceeds {limit} tokens")
        temperature = number(body, "temperature", 1.0, 0.0, 2.0)
        kw: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": temperature > 0}
        if temperature > 0:
            kw["temperature"] = temperature
            kw["top_p"] = number(body, "top_p", 1.0, 0.0, 1.0)
            if body.get("top_k") not in (None, 0, -1):
                kw["top_k"] = int(number(body, "top_k", 0, 1, 1 << 30))
            else:
                kw["top_k"] = None
        if body.get("ignore_eos"):
            kw["eos_token_id"] = None  # no EOS stopping criterion; EOS may be generated and go on
        if body.get("seed") is not None:
            torch.manual_seed(int(body["seed"]))
        return kw

    def stops(body: dict[str, Any]) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str) and s]

    async def run(body: dict[str, Any], chat: bool) -> AsyncIterator[tuple[int, str, bool]]:
        """Yields (n_tokens, text_delta, stopped_by_stop_string); runs under the lock."""
        ids = prompt_ids(body, chat)
        kw = gen_kwargs(body, len(ids), chat)
        stop_strings = stops(body)
        streamer = TokenStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = Cancel()
        inputs = torch.tensor([ids])
        error: list[BaseException] = []

        def target() -> None:
            try:
                with torch.inference_mode():
                    model.generate(
                        inputs,
                        attention_mask=torch.ones_like(inputs),
                        streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([cancel]),
                        **kw,
                    )
            except BaseException as e:  # surfaced to the client below
                error.append(e)
                streamer.end()

        thread = threading.Thread(target=target, daemon=True)
        text = ""
        try:
            thread.start()
            iterator = iter(streamer)
            while True:
                item = await asyncio.to_thread(next, iterator, None)
                if item is None:
                    break
                n, delta = item
                if stop_strings and delta:
                    joined = text + delta  # a stop string may begin in the text already sent
                    found = [joined.find(s, max(0, len(text) - len(s) + 1)) for s in stop_strings]
                    hits = [i for i in found if i >= 0]
                    if hits:
                        yield n, delta[: max(min(hits) - len(text), 0)], True
                        cancel.event.set()
                        break
                text += delta
                yield n, delta, False
        finally:
            cancel.event.set()
            await asyncio.to_thread(thread.join)
        if error:
            raise ApiError(500, f"generation failed: {error[0]!r}")

    def usage(n_prompt: int, n_out: int) -> dict[str, int]:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    app = FastAPI(title="transformers peer (DeepSeek-V4, one request at a time)")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(
            {"error": {"message": exc.message, "type": kind, "code": exc.status}}, status_code=exc.status
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "transformers"}],
        }

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise ApiError(400, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object")
        if body.get("model") not in (None, model_id):
            raise ApiError(404, f"model {body.get('model')!r} not served; this server has {model_id!r}")
        ids = prompt_ids(body, chat)  # validate before streaming starts
        gen_kwargs(body, len(ids), chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        max_tokens = int(body.get(max_key(body, chat)) or (256 if chat else 16))

        def finish(n_out: int, stopped: bool) -> str:
            return "length" if n_out >= max_tokens and not stopped else "stop"

        if not body.get("stream"):
            async with lock:
                n_out, parts, stopped = 0, [], False
                async for n, delta, hit in run(body, chat):
                    n_out += n
                    parts.append(delta)
                    stopped = stopped or hit
            text = "".join(parts)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish(n_out, stopped), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_id,
                "choices": [choice],
                "usage": usage(len(ids), n_out),
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: str | None, finish_reason: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if delta is not None and not first:
                    d["content"] = delta
                c: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish_reason, "logprobs": None}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": None}
            payload = {
                "id": rid,
                "object": obj + ("" if not chat else ".chunk"),
                "created": created,
                "model": model_id,
                "choices": [c],
            }
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            async with lock:
                if chat:
                    yield chunk(None, None, first=True)
                n_out, stopped = 0, False
                try:
                    async for n, delta, hit in run(body, chat):
                        n_out += n
                        stopped = stopped or hit
                        if delta or not chat:
                            yield chunk(delta, None)
                except ApiError as e:
                    yield f"data: {json.dumps({'error': {'message': e.message, 'code': e.status}})}\n\n"
                    return
                yield chunk(None if chat else "", finish(n_out, stopped))
                if include_usage:
                    payload = {
                        "id": rid,
                        "object": obj + (".chunk" if chat else ""),
                        "created": created,
                        "model": model_id,
                        "choices": [],
                        "usage": usage(len(ids), n_out),
                    }
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model}: no config.json")
    if args.backend == "serve":
        exec_transformers_serve(args)  # does not return
    import uvicorn

    app = build_app(args)
    print(
        f"wrapper serving {args.model!r} as {args.served_model_name or args.model!r} "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
