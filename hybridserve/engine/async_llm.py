"""AsyncLLM: the API process's asyncio front for the engine core, which runs in its own process.

Requests go to the core as messages; its token outputs come back and are detokenised here, where
stop strings are found too (vLLM's output processor). A core that dies fails every stream and calls
``on_fatal``; it is never waited on forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hybridserve.config import EngineConfig
from hybridserve.engine.client.core_client import EngineCoreClient
from hybridserve.engine.client.dp_client import DPEngineCoreClient
from hybridserve.engine.errors import (
    EngineDeadError,
    EngineStoppedError,
    HandoffFailedError,
    RequestFailedError,
    RequestRejected,
)
from hybridserve.engine.messages import (
    AddRequest,
    CoreOutput,
    EngineFailed,
    FinishRequests,
    Rejected,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.outputs import EngineCoreOutput
from hybridserve.engine.request import FinishReason, Request, RequestOutput
from hybridserve.engine.stats import EngineSnapshot
from hybridserve.tokenizer import load_tokenizer

log = logging.getLogger("hybridserve.engine")


@dataclass
class RequestTiming:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)
    kv_handoff_seconds: float | None = None  # decode worker: the pull of the request's blocks


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        """Starts the engine-core process and waits until it has loaded the model (blocking)."""
        self.config = config
        self.tokenizer = load_tokenizer(config.model, config.tokenizer_mode)
        self.client: EngineCoreClient | DPEngineCoreClient = (
            DPEngineCoreClient(config) if config.data_parallel_size > 1 else EngineCoreClient(config)
        )
        self.info = self.client.ready
        self.limits = self.info.limits
        self.stats: EngineSnapshot = self.info.snapshot  # as of the core's last message
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.timings: dict[str, RequestTiming] = {}
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self.errored: BaseException | None = None
        self.on_finish: list = []  # callbacks(RequestOutput, RequestTiming), e.g. metrics and logs
        self.on_fatal: list[Callable[[BaseException], None]] = []  # the engine died (in the event loop)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's outputs in the running event loop."""
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_outputs())
        self.client.on_exit(loop, self._core_exited)

    async def shutdown(self) -> None:
        """Stop reading, then stop the core process (waiting for it in a worker thread)."""
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self.client.stop_watching(asyncio.get_running_loop())
        await asyncio.to_thread(self.client.close)

    @property
    def ready(self) -> bool:
        return self._reader is not None and self.errored is None

    # ---- what the engine can serve --------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_request_tokens(self) -> int:
        return self.limits.max_request_tokens

    def check(self, request: Request) -> None:
        """Raise RequestRejected now if the engine could never serve ``request``."""
        if request.request_id in self._streams:
            raise RequestRejected(f"request id {request.request_id!r} is already in use", param=None)
        self.limits.check(request.prompt_token_ids, request.params)

    # ---- requests -----------------------------------------------------------------------------
    def request_ids(self) -> list[str]:
        return list(self._streams)

    @property
    def rank_stats(self) -> dict[int, EngineSnapshot]:
        """Each data-parallel rank's own snapshot (one entry when there is one rank)."""
        return getattr(self.client, "rank_stats", None) or {0: self.stats}

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - self.stats.num_running)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (done between two steps of the core)."""
        await self._call("reset_prefix_cache")

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
        if self.errored is not None:
            raise EngineDeadError(f"the engine stopped: {self.errored}")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self.timings[request.request_id] = RequestTiming()
        self.processor.add_request(request)
        finished = False
        try:
            self.client.send(
                AddRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    request.prompt,
                    request.remote_decode,
                    request.remote_prefill,
                )
            )
            yield None
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the core has already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)
            self.processor.abort_request(request.request_id)
            self._streams.pop(request.request_id, None)
            self.timings.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Abort a running request; its blocks are freed before the core's next step."""
        if request_id not in self._streams:
            return False
        self._finish([request_id], FinishReason.ABORT)
        out = self.processor.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        return True

    def stop_all(self, reason: str) -> None:
        """Fail every unfinished request now with EngineStoppedError (and free its blocks)."""
        ids = list(self._streams)
        self._finish(ids, FinishReason.ABORT)
        for request_id in ids:
            self.processor.abort_request(request_id)
            self._fail(request_id, EngineStoppedError(reason))

    def _finish(self, request_ids: list[str], reason: FinishReason, stop: int | str | None = None) -> None:
        if request_ids and self.errored is None:
            with contextlib.suppress(EngineDeadError):  # a core that is gone holds no blocks to free
                self.client.send(FinishRequests(request_ids, reason, stop))

    def release_handoffs(self, request_ids: list[str]) -> None:
        """Prefill worker: free the blocks of handed-off requests no decode worker will pull."""
        self._finish(request_ids, FinishReason.ABORT)

    async def _call(self, method: str) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine stopped: {self.errored}")
        call_id = next(self._call_ids)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = done
        self.client.send(UtilityCall(call_id, method))
        await done

    # ---- outputs from the core (in the event loop) --------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            message = await self.client.recv()
            try:
                self._on_message(message)
            except Exception:  # a bug here must not stop every other stream's outputs
                log.exception("could not process the engine core's outputs")

    def _on_message(self, message: CoreOutput) -> None:
        if isinstance(message, StepOutputs):
            self.stats = message.snapshot
            self._on_outputs(message.outputs)
        elif isinstance(message, Rejected):
            self.processor.abort_request(message.request_id)
            self._fail(message.request_id, RequestRejected(message.message, message.code, message.param))
        elif isinstance(message, UtilityResult):
            self._on_result(message)
        elif isinstance(message, EngineFailed):
            self._die(EngineDeadError(message.message))

    def _on_result(self, result: UtilityResult) -> None:
        done = self._calls.pop(result.call_id, None)
        if done is None or done.done():
            return
        if result.error is None:
            done.set_result(None)
        else:
            done.set_exception(RuntimeError(result.error))

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        for failed in outputs:
            if failed.error is not None:
                self.processor.abort_request(failed.request_id)
                kind = HandoffFailedError if failed.handoff_failed else RequestFailedError
                self._fail(failed.request_id, kind(failed.error))
        live = [o for o in outputs if o.error is None and o.request_id in self.processor.states]
        for o in live:  # every step counts, also those whose outputs a FINAL_ONLY request never sees
            self._stamp(o.request_id, now, o.kv_handoff_seconds)
        results, stopped = self.processor.process(live)
        handoffs = {o.request_id: o.kv_transfer for o in outputs if o.kv_transfer is not None}
        for request_id, stop in stopped:
            self._finish([request_id], FinishReason.STOP, stop)
        for out in results:
            out.kv_transfer = handoffs.get(out.request_id)
            timing = self.timings.get(out.request_id)
            out.kv_handoff_seconds = timing.kv_handoff_seconds if timing is not None else None
            self._deliver(out)

    def _stamp(self, request_id: str, now: float, handoff_seconds: float | None) -> None:
        timing = self.timings.get(request_id)
        if timing is None:
            return
        if handoff_seconds is not None:
            timing.kv_handoff_seconds = handoff_seconds
        if timing.first_token is None:
            timing.first_token = now
        elif timing.last_token is not None:
            timing.token_gaps.append(now - timing.last_token)
        timing.last_token = now

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)
        if out.finished:
            timing = self.timings.get(out.request_id)
            for callback in self.on_finish:
                callback(out, timing)

    def _core_exited(self, exitcode: int | None) -> None:
        if not self._closing:
            self._die(EngineDeadError(f"the engine-core process exited unexpectedly (status {exitcode})"))

    def _die(self, exc: EngineDeadError) -> None:
        if self.errored is not None:
            return
        log.error("engine core failed: %s", exc)
        self.errored = exc
        for stream in self._streams.values():
            stream.put_nowait(exc)
        for done in self._calls.values():
            if not done.done():
                done.set_exception(exc)
        for callback in self.on_fatal:
            callback(exc)
