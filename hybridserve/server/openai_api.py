"""The FastAPI app: OpenAI endpoints, health, metrics, admin; API key and size limits."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import Request as HTTPRequest

from hybridserve import __version__
from hybridserve.config import EngineConfig
from hybridserve.engine.async_llm import AsyncLLM, RequestTiming
from hybridserve.engine.request import RequestOutput
from hybridserve.engine.sample.structured_outputs import warm_grammar_checks
from hybridserve.server.body import OffLoopRoute
from hybridserve.server.chat import create_chat_completion
from hybridserve.server.completions import create_completion
from hybridserve.server.errors import APIError, error_response, install_error_handlers
from hybridserve.server.gc_pause import freeze_startup_heap, thaw_heap
from hybridserve.server.limits import BodySizeLimit, refuse_cross_site
from hybridserve.server.loop_lag import LoopLagMonitor
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.openapi import GENERATE_RESPONSES, TOKENIZE_RESPONSES, responses
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    KvReleaseRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from hybridserve.server.responses import create_response
from hybridserve.server.responses_input import ResponsesRequest
from hybridserve.server.serving import ServerSettings, api_id
from hybridserve.server.tokenize import detokenize, tokenize

log = logging.getLogger("hybridserve.server")


class AppState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.loop_lag = LoopLagMonitor(self.metrics.registry)
        self.lag_task: asyncio.Task[None] | None = None
        self.llm: AsyncLLM | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.fatal: BaseException | None = None  # the engine died: the process must exit non-zero
        self.request_exit: Callable[[], None] = lambda: None  # set by the launcher (uvicorn)

    def engine(self) -> AsyncLLM:
        """The running engine, or 503 while it loads, after it failed, or while the server drains."""
        failure = self.load_error or (self.llm.errored if self.llm is not None else None)
        if failure is not None:
            raise APIError(503, f"the engine failed: {failure}", code="engine_failed")
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if self.llm is None or not self.llm.ready:
            raise APIError(503, "the engine is loading", code="engine_not_ready")
        return self.llm

    def die(self, exc: BaseException) -> None:
        """The engine cannot go on: never stay up half-dead; exit so an orchestrator restarts us."""
        log.critical("the engine cannot go on (%s); exiting", exc)
        self.fatal = exc
        self.request_exit()

    def begin_drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new requests; past ``grace_s`` fail the unfinished ones with a 503."""
        self.draining = True
        if self.llm is not None:
            llm = self.llm
            asyncio.get_running_loop().call_later(grace_s, llm.stop_all, "the server shut down")


def _log_finished(out: RequestOutput, timing: RequestTiming | None) -> None:
    c = out.outputs[0]
    ttft = f"{timing.first_token - timing.arrival:.3f}s" if timing and timing.first_token else "-"
    log.info(
        "request %s: prompt %d tokens, completion %d tokens, ttft %s, finish %s",
        out.request_id,
        len(out.prompt_token_ids),
        out.num_output_tokens,
        ttft,
        c.finish_reason,
    )


def build_app(
    config: EngineConfig, settings: ServerSettings, make_engine: Callable[[EngineConfig], AsyncLLM] = AsyncLLM
) -> FastAPI:
    state = AppState(settings)

    async def load() -> None:
        try:
            llm = await asyncio.to_thread(make_engine, config)
            if settings.chat_template is not None and llm.tokenizer is not None:
                llm.tokenizer.chat_template = settings.chat_template
                llm.tokenizer.mode = "hf"  # a template given explicitly is what the user wants rendered
            llm.start()
            llm.on_finish.append(_log_finished)
            llm.on_fatal.append(state.die)
            state.metrics.attach(llm)
            freeze_startup_heap()
            state.llm = llm
            state.lag_task = asyncio.create_task(state.loop_lag.run())  # start-up's own stalls not counted
            _log_startup(llm, settings)
        except Exception as exc:
            log.exception("could not start the engine")
            state.load_error = exc
            state.die(exc)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        await asyncio.sleep(0)  # the engine-core process starts now, beside the import below
        # Before serving, on this thread: importing xgrammar (it imports transformers, whose lazy module
        # another thread must not import at the same time; starting the engine imports none of it)
        # costs ~1.3 s, which the first constrained request would otherwise spend on the event loop.
        warm_grammar_checks()
        yield
        await asyncio.wait({loading})
        if state.lag_task is not None:
            state.lag_task.cancel()
        if state.llm is not None:
            await state.llm.shutdown()
            thaw_heap()

    app = FastAPI(title="hybridserve", version=__version__, lifespan=lifespan)
    app.router.route_class = OffLoopRoute  # bodies are decoded and validated off the event loop
    app.state.hs = state
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    install_error_handlers(app, on_error=lambda status: state.metrics.rejected.labels(str(status)).inc())
    _routes(app, state)
    return app


def _log_startup(llm: AsyncLLM, settings: ServerSettings) -> None:
    info = llm.info
    log.info(
        "model %s (%s) on %s, dtype %s; cache: %d tokens per request at most, %s",
        settings.model_name,
        llm.config.model,
        info.device,
        info.dtype,
        llm.max_request_tokens,
        f"{info.cache_bytes / 2**20:.1f} MiB in {info.num_cache_groups} groups",
    )


def _routes(app: FastAPI, state: AppState) -> None:
    def auth(request: HTTPRequest) -> None:
        key = state.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key"
            )

    guarded: Any = [Depends(auth), Depends(refuse_cross_site)]

    @app.get("/health", responses=responses(503))
    async def health() -> JSONResponse:
        """200 with ``{"status": "ok"}`` when the engine serves; 503 while loading, draining or failed."""
        state.engine()
        return JSONResponse({"status": "ok"})

    @app.head("/health", responses=responses(503))
    async def health_head() -> JSONResponse:
        return await health()  # the server sends the headers only

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post(
        "/tokenize", dependencies=guarded, response_model=TokenizeResponse, responses=TOKENIZE_RESPONSES
    )
    async def tokenize_route(body: TokenizeRequest) -> Response:
        return await tokenize(body, state.engine(), state.settings)

    @app.post(
        "/detokenize", dependencies=guarded, response_model=DetokenizeResponse, responses=TOKENIZE_RESPONSES
    )
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        return await detokenize(body, state.engine(), state.settings)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=guarded, response_model=ModelList, responses=responses(401, 503))
    async def models() -> JSONResponse:
        llm = state.engine()
        card = ModelCard(
            id=state.settings.model_name, root=llm.config.model, max_model_len=llm.max_request_tokens
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post(
        "/v1/completions",
        dependencies=guarded,
        response_model=CompletionResponse,
        responses=GENERATE_RESPONSES,
    )
    async def completions(body: CompletionRequest, raw: HTTPRequest) -> Response:
        return await create_completion(body, raw, state.engine(), state.settings)

    @app.post(
        "/v1/chat/completions",
        dependencies=guarded,
        response_model=ChatCompletionResponse,
        responses=GENERATE_RESPONSES,
    )
    async def chat(body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        return await create_chat_completion(body, raw, state.engine(), state.settings)

    @app.post("/v1/responses", dependencies=guarded, responses=GENERATE_RESPONSES)
    async def responses_route(body: ResponsesRequest, raw: HTTPRequest) -> Response:
        """OpenAI's Responses API: text or items in, reasoning, message and function_call items out;
        ``store`` false only (nothing is kept between requests)."""
        return await create_response(body, raw, state.engine(), state.settings)

    @app.post(
        "/v1/requests/{request_id}/abort", dependencies=guarded, responses=responses(401, 404, 415, 503)
    )
    async def abort(request_id: str) -> JSONResponse:
        """Abort one request, all of its choices, by the exact id its response carries (``cmpl-…`` or
        ``chatcmpl-…``: 128 random bits, so only a client that saw the response can name it)."""
        llm = state.engine()
        aborted = [r for r in llm.request_ids() if api_id(r) == request_id]
        for r in aborted:
            llm.abort(r)
        if not aborted:
            return error_response(404, f"no running request {request_id!r}", code="request_not_found")
        return JSONResponse({"id": request_id, "aborted": len(aborted)})

    @app.post("/v1/kv/release", dependencies=guarded, responses=responses(400, 401, 415, 503))
    async def release_kv(body: KvReleaseRequest) -> JSONResponse:
        """Prefill worker: free handed-off blocks that no decode worker will pull (the router calls this
        when a request ends before its decode worker pulled; unknown handles are ignored)."""
        state.engine().release_handoffs(body.handles)
        return JSONResponse({"released": len(body.handles)})

    @app.post("/v1/cache/reset", dependencies=guarded, responses=responses(401, 415, 503))
    async def reset_cache() -> JSONResponse:
        await state.engine().reset_prefix_cache()
        return JSONResponse({"reset": True})
