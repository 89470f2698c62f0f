"""AsyncLLM: an asyncio front for EngineCore.

The core runs in its own thread and talks only in plain messages (add, abort, finish in; token
outputs out), so it could move to its own process unchanged. Detokenisation and stop strings
happen here, in the event loop, like vLLM's output processor.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hybridserve.config import EngineConfig
from hybridserve.engine.core import EngineCore, EngineCoreOutput, RequestRejected
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.request import FinishReason, Request, RequestOutput
from hybridserve.tokenizer import load_tokenizer

log = logging.getLogger("hybridserve.engine")


@dataclass
class _Add:
    request: Request


@dataclass
class _Finish:
    request_id: str
    reason: FinishReason
    stop_reason: int | str | None = None


@dataclass
class _ResetPrefixCache:
    done: asyncio.Future[None]


@dataclass
class _Shutdown:
    pass


_Message = _Add | _Finish | _ResetPrefixCache | _Shutdown


@dataclass
class RequestTiming:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(config.model)
        self.processor = OutputProcessor(self.tokenizer)
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.timings: dict[str, RequestTiming] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None
        self.on_finish: list = []  # callbacks(RequestOutput, RequestTiming), e.g. metrics and logs

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_core, name="engine-core", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(_Shutdown())
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    # ---- requests -----------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise RequestRejected now if the engine could never serve ``request``."""
        self.core.validate(request)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (done between two steps of the core thread)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put(_ResetPrefixCache(done))
        await done

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - len(self.core.scheduler.running))

    async def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` now and return the stream of its outputs.

        The request counts as waiting as soon as this returns (so admission checks that run before
        it are exact); closing the stream early, or dropping it, aborts the request.
        """
        stream = self._generate(request)
        await anext(stream)  # runs up to the registration; the outputs follow
        return stream  # type: ignore[return-value]

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; leaving the iterator early aborts the request."""
        async for out in await self.submit(request):
            yield out

    async def _generate(self, request: Request) -> AsyncIterator[RequestOutput | None]:
        self.check(request)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self.timings[request.request_id] = RequestTiming()
        self.processor.add_request(request)
        self._inbox.put(_Add(request))
        finished = False
        try:
            yield None
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)
            self._streams.pop(request.request_id, None)
            self.timings.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Abort a running request; its blocks are freed before the next step."""
        if request_id not in self._streams:
            return False
        self._inbox.put(_Finish(request_id, FinishReason.ABORT))
        out = self.processor.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        return True

    # ---- the core thread ----------------------------------------------------------------------
    def _run_core(self) -> None:
        try:
            while True:
                block = not self.core.has_unfinished_requests()
                if not self._drain(block):
                    return
                outputs = self.core.step()
                if outputs:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
        except BaseException as exc:  # the engine is dead: fail every stream instead of hanging
            log.exception("engine core failed")
            self.errored = exc
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _drain(self, block: bool) -> bool:
        """Apply queued messages; False on shutdown."""
        try:
            msg = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, _Shutdown):
                return False
            if isinstance(msg, _Add):
                self._add(msg.request)
            elif isinstance(msg, _ResetPrefixCache):
                self.core.reset_prefix_cache()
                assert self._loop is not None
                self._loop.call_soon_threadsafe(msg.done.set_result, None)
            else:
                self.core.finish_request(msg.request_id, msg.reason, msg.stop_reason)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: Request) -> None:
        try:
            self.core.add_request(request)
        except RequestRejected as exc:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail, request.request_id, exc)

    # ---- back in the event loop ---------------------------------------------------------------
    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        results, stopped = self.processor.process(outputs)
        for request_id, stop in stopped:
            self._inbox.put(_Finish(request_id, FinishReason.STOP, stop))
        for out in results:
            timing = self.timings.get(out.request_id)
            if timing is not None:
                if timing.first_token is None:
                    timing.first_token = now
                elif timing.last_token is not None:
                    timing.token_gaps.append(now - timing.last_token)
                timing.last_token = now
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)
        if out.finished:
            timing = self.timings.get(out.request_id)
            for callback in self.on_finish:
                callback(out, timing)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(RuntimeError(f"the engine stopped: {exc}"))
