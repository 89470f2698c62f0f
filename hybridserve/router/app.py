"""``hybridserve router``: one OpenAI endpoint in front of prefill and decode workers.

Each generation request goes to a prefill worker (prompt, first token, blocks held for a handoff), then
with its answer to a decode worker, which pulls the blocks and streams the completion back through the
router. ``max_tokens = 1`` finishes on the prefill worker. Workers that fail are marked down, their
requests fail with a JSON 5xx within seconds, and the health loop takes them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request as HTTPRequest

from hybridserve import __version__
from hybridserve.router.forward import with_fields
from hybridserve.router.stream_params import ParamsFilter
from hybridserve.router.workers import Worker, WorkerDown, WorkerPool, health_loop, mark_down
from hybridserve.server.body import OffLoopRoute
from hybridserve.server.errors import APIError, error_body, error_response, install_error_handlers
from hybridserve.server.kv_transfer_params import PARAM, handles, handoff_bytes, handoff_seconds
from hybridserve.server.limits import BodySizeLimit, refuse_cross_site
from hybridserve.server.openapi import ROUTER_GENERATE_RESPONSES, responses
from hybridserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    _SamplingFields,
)
from hybridserve.server.streams import sse, unless_disconnected

log = logging.getLogger("hybridserve.router")

_HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

_FORWARDED_HEADERS = ("authorization", "content-type")


@dataclass
class RouterSettings:
    prefill: list[str]
    decode: list[str]
    worker_timeout_s: float = 600.0  # longest silence of a worker mid-request (health checks act sooner)
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # checks in a row that time out before a slow worker goes down
    max_body_bytes: int = 4 << 20


class _RouterCollector(Collector):
    def __init__(self, pools: list[WorkerPool]) -> None:
        self.worker_pools = pools

    def collect(self) -> list[Metric]:
        up = GaugeMetricFamily(
            "hybridserve_router_worker_up", "1 if the worker is up", labels=["role", "url"]
        )
        busy = GaugeMetricFamily(
            "hybridserve_router_worker_requests_in_flight", "requests in flight", labels=["role", "url"]
        )
        for pool in self.worker_pools:
            for w in pool.workers:
                up.add_metric([w.role, w.url], float(w.up))
                busy.add_metric([w.role, w.url], w.in_flight)
        return [up, busy]


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "hybridserve_router_requests", "requests answered", ["endpoint", "status"], registry=r
        )
        self.failures = Counter(
            "hybridserve_router_worker_failures", "requests a worker failed", ["role"], registry=r
        )
        self.prefill_seconds = Histogram(
            "hybridserve_router_prefill_seconds", "time to the prefill worker's answer", registry=r
        )
        self.handoff_bytes = Counter(
            "hybridserve_router_handoff_bytes", "KV bytes handed to decode workers", ["group"], registry=r
        )
        # One buffer carries every cache group, so a pull has one time (by decode worker, not by group)
        self.handoff_seconds = Histogram(
            "hybridserve_router_handoff_seconds",
            "KV pull time of a choice on its decode worker, every cache group together",
            ["url"],
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )

    def observe_handoff(self, params: dict[str, Any]) -> None:
        for group, n in handoff_bytes(params).items():
            self.handoff_bytes.labels(group).inc(n)

    def observe_pull(self, worker: Worker, params: dict[str, Any]) -> None:
        for seconds in handoff_seconds(params):
            self.handoff_seconds.labels(worker.url).observe(seconds)


@dataclass
class _Prefilled:
    worker: Worker
    params: dict[str, Any]


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.prefill = WorkerPool("prefill", settings.prefill)
        self.decode = WorkerPool("decode", settings.decode)
        self.metrics = RouterMetrics()
        self.metrics.registry.register(_RouterCollector([self.prefill, self.decode]))
        self._background: set[asyncio.Task[None]] = set()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.worker_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None),
        )

    async def generate(self, path: str, body: _SamplingFields, raw: HTTPRequest) -> Response:
        """``body`` has passed the server's own validation; the workers get the client's bytes as sent."""
        sent = await raw.body()
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if _max_tokens(body) == 1:  # the first token is the last: no handoff
            return await self._send(self.prefill, path, sent, headers, body.stream, raw)
        prefilled = await unless_disconnected(raw, lambda: self._prefill(path, sent, headers))
        if prefilled is None:
            return Response(status_code=499)
        if isinstance(prefilled, Response):
            return prefilled
        decode_body = with_fields(sent, {PARAM: prefilled.params})
        release = self._releaser(prefilled, headers)
        try:
            response = await self._send(self.decode, path, decode_body, headers, body.stream, raw, release)
        except BaseException:
            release()
            raise
        if response.status_code != 200:
            release()
        return response

    async def _prefill(self, path: str, sent: bytes, headers: dict[str, str]) -> _Prefilled | Response:
        fields = {"stream": False, "stream_options": None, PARAM: {"do_remote_decode": True}}
        start = time.monotonic()
        worker, resp = await self._post(self.prefill, path, with_fields(sent, fields), headers)
        self.metrics.prefill_seconds.observe(time.monotonic() - start)
        if resp.status_code != 200:
            return _passthrough(resp)
        params = resp.json().get(PARAM)
        if not isinstance(params, dict):
            raise APIError(
                502,
                f"the prefill worker at {worker.url} answered without {PARAM} "
                f"(start it with --disaggregation-mode prefill)",
                code="worker_failed",
            )
        self.metrics.observe_handoff(params)
        return _Prefilled(worker, params)

    async def _post(
        self, pool: WorkerPool, path: str, content: bytes, headers: dict[str, str]
    ) -> tuple[Worker, httpx.Response]:
        async def post(worker: Worker) -> httpx.Response:
            url = f"{worker.url}{path}"
            return await worker.guard(self.client.post(url, content=content, headers=headers))

        return await self._with_worker(pool, post)

    async def _with_worker(
        self, pool: WorkerPool, call: Callable[[Worker], Awaitable[httpx.Response]]
    ) -> tuple[Worker, httpx.Response]:
        """Run ``call`` on the least busy worker that is up; one that cannot be reached is marked down and
        the next one tried (a request that reached a worker is never sent twice)."""
        tried: set[Worker] = set()
        while True:
            worker = pool.pick(tried)
            tried.add(worker)
            worker.in_flight += 1
            try:
                return worker, await call(worker)
            except WorkerDown as exc:
                self._failed(worker, str(exc))
                if not isinstance(exc.__cause__, httpx.ConnectError):
                    raise APIError(502, str(exc), code="worker_failed") from exc
            finally:
                worker.in_flight -= 1

    async def _send(
        self,
        pool: WorkerPool,
        path: str,
        content: bytes,
        headers: dict[str, str],
        stream: bool,
        raw: HTTPRequest,
        on_error: Callable[[], None] = lambda: None,
    ) -> Response:
        if not stream:
            result = await unless_disconnected(raw, lambda: self._post(pool, path, content, headers))
            if result is None:
                return Response(status_code=499)
            self._observe_answer(*result)
            return _passthrough(result[1])

        async def open_stream(worker: Worker) -> httpx.Response:
            url = f"{worker.url}{path}"
            request = self.client.build_request("POST", url, content=content, headers=headers)
            return await worker.guard(self.client.send(request, stream=True))

        worker, resp = await self._with_worker(pool, open_stream)
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            return _passthrough(resp)
        worker.in_flight += 1
        return StreamingResponse(self._pipe(worker, resp, on_error), media_type="text/event-stream")

    async def _pipe(
        self, worker: Worker, resp: httpx.Response, on_error: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        chunks, params = resp.aiter_raw(), ParamsFilter()
        try:
            while (chunk := await worker.guard(_next(chunks))) is not None:
                if passed := params.feed(chunk):
                    yield passed
            if rest := params.flush():
                yield rest
            for found in params.found:
                self.metrics.observe_pull(worker, found)
        except WorkerDown as exc:
            self._failed(worker, str(exc))
            on_error()
            yield sse(error_body(502, str(exc), code="worker_failed")).encode()
            yield sse("[DONE]").encode()
        finally:
            worker.in_flight -= 1
            await resp.aclose()

    def _observe_answer(self, worker: Worker, resp: httpx.Response) -> None:
        """A decode worker's JSON answer: its pull times (a cheap look first: most answers have none)."""
        if resp.status_code != 200 or f'"{PARAM}":{{'.encode() not in resp.content:
            return
        params = resp.json().get(PARAM)
        if isinstance(params, dict):
            self.metrics.observe_pull(worker, params)

    def _failed(self, worker: Worker, why: str) -> None:
        self.metrics.failures.labels(worker.role).inc()
        mark_down(worker, why)

    def _releaser(self, prefilled: _Prefilled, headers: dict[str, str]) -> Callable[[], None]:
        """Frees the prefill worker's held blocks if no decode worker pulls them (harmless if one did)."""
        ids = handles(prefilled.params)
        url = f"{prefilled.worker.url}/v1/kv/release"

        async def release() -> None:
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(url, json={"handles": ids}, headers=headers, timeout=5.0)

        def start() -> None:
            if ids:
                task = asyncio.get_running_loop().create_task(release())
                self._background.add(task)
                task.add_done_callback(self._background.discard)

        return start

    async def models(self, raw: HTTPRequest) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}

        async def get(worker: Worker) -> httpx.Response:
            return await worker.guard(self.client.get(f"{worker.url}/v1/models", headers=headers))

        return _passthrough((await self._with_worker(self.prefill, get))[1])

    async def _broadcast(self, path: str, raw: HTTPRequest) -> list[httpx.Response]:
        """POST ``path`` to every worker that is up; -> the answers of those that could be reached."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        workers = [w for pool in (self.decode, self.prefill) for w in pool.workers if w.up]

        async def one(worker: Worker) -> httpx.Response | None:
            with contextlib.suppress(httpx.HTTPError):
                url = f"{worker.url}{path}"
                return await self.client.post(url, headers=headers, timeout=self.settings.health_timeout_s)
            return None

        return [r for r in await asyncio.gather(*(one(w) for w in workers)) if r is not None]

    async def abort(self, request_id: str, raw: HTTPRequest) -> Response:
        """Forward an abort to every worker that is up: the id names a request on one of them."""
        answers = await self._broadcast(f"/v1/requests/{quote(request_id, safe='')}/abort", raw)
        found = next((r for r in answers if r.status_code == 200), None)
        if found is not None:
            return _passthrough(found)
        refused = next((r for r in answers if r.status_code in (401, 415)), None)
        if refused is not None:
            return _passthrough(refused)
        return error_response(404, f"no running request {request_id!r}", code="request_not_found")

    async def reset_cache(self, raw: HTTPRequest) -> Response:
        """Reset the prefix cache of every worker that is up (each keeps its own)."""
        answers = await self._broadcast("/v1/cache/reset", raw)
        refused = next((r for r in answers if r.status_code != 200), None)
        if refused is not None:
            return _passthrough(refused)
        if not answers:
            return error_response(503, "no worker is up", code="no_worker_available")
        return JSONResponse({"reset": True, "workers": len(answers)})

    async def close(self) -> None:
        await self.client.aclose()


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    with contextlib.suppress(StopAsyncIteration):
        return await anext(chunks)
    return None


def _max_tokens(body: _SamplingFields) -> int | None:
    limit: int | None = getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None)
    return limit


def _passthrough(resp: httpx.Response) -> Response:
    media = resp.headers.get("content-type", "application/json")
    return Response(resp.content, status_code=resp.status_code, media_type=media)


def build_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pools = [router.prefill, router.decode]
        checker = asyncio.create_task(
            health_loop(
                router.client,
                pools,
                settings.health_interval_s,
                settings.health_timeout_s,
                settings.health_failures,
            )
        )
        yield
        checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checker
        await router.close()

    app = FastAPI(title="hybridserve router", version=__version__, lifespan=lifespan)
    app.router.route_class = OffLoopRoute  # the server's validation, off the event loop, as it does
    app.state.router = router
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)
    _routes(app, router)
    return app


def _routes(app: FastAPI, router: Router) -> None:
    @app.get("/health", responses=responses(503))
    async def health() -> JSONResponse:
        """200 while at least one prefill and one decode worker are up, else 503."""
        up = {"prefill": router.prefill.num_up, "decode": router.decode.num_up}
        if not all(up.values()):
            down = [role for role, n in up.items() if not n]
            return error_response(503, f"no {' and no '.join(down)} worker is up", code="no_worker_available")
        return JSONResponse({"status": "ok", "workers_up": up})

    @app.head("/health", responses=responses(503))
    async def health_head() -> JSONResponse:
        return await health()  # the server sends the headers only

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=responses(401, 503))
    async def models(raw: HTTPRequest) -> Response:
        return await router.models(raw)

    guarded: Any = [Depends(refuse_cross_site)]  # the workers check the API key the router forwards

    @app.post(
        "/v1/requests/{request_id}/abort", dependencies=guarded, responses=responses(401, 404, 415, 503)
    )
    async def abort(request_id: str, raw: HTTPRequest) -> Response:
        return await router.abort(request_id, raw)

    @app.post("/v1/cache/reset", dependencies=guarded, responses=responses(401, 415, 503))
    async def reset_cache(raw: HTTPRequest) -> Response:
        return await router.reset_cache(raw)

    counts = router.metrics

    @app.post(
        "/v1/completions",
        dependencies=guarded,
        response_model=CompletionResponse,
        responses=ROUTER_GENERATE_RESPONSES,
    )
    async def completions(body: CompletionRequest, raw: HTTPRequest) -> Response:
        return await _counted(counts, "/v1/completions", router.generate("/v1/completions", body, raw))

    @app.post(
        "/v1/chat/completions",
        dependencies=guarded,
        response_model=ChatCompletionResponse,
        responses=ROUTER_GENERATE_RESPONSES,
    )
    async def chat(body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        path = "/v1/chat/completions"
        return await _counted(counts, path, router.generate(path, body, raw))


async def _counted(metrics: RouterMetrics, path: str, answer: Awaitable[Response]) -> Response:
    try:
        response = await answer
    except APIError as exc:
        metrics.requests.labels(path, str(exc.status)).inc()
        raise
    metrics.requests.labels(path, str(response.status_code)).inc()
    return response
