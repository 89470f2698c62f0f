"""The engine-core process: load the model, then a busy loop of (apply messages, step, send outputs).

vLLM V1's shape: the API process tokenises, detokenises and streams; this process only schedules and
runs the model, so neither waits on the other's GIL. Messages are msgspec msgpack over two ZMQ PUSH/PULL
sockets that the API process binds.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
from dataclasses import dataclass

import torch
import zmq

from hybridserve.config import EngineConfig
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.messages import (
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineFailed,
    EngineReady,
    FinishRequests,
    Rejected,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    decode_input,
    encode,
)
from hybridserve.engine.request import Request

log = logging.getLogger("hybridserve.engine")

# Idle, the core wakes this often to notice that the API process is gone.
_PARENT_CHECK_MS = 1000
_HANDOFF_POLL_MS = 1
PLUGINS_ENV = "HYBRIDSERVE_PLUGINS"


class ApiProcessGone(Exception):
    """The API process exited: nobody reads this core's outputs any more."""


def send_while_parent_lives(sock: zmq.Socket, data: bytes, parent: int) -> None:
    """Send ``data``; raise ApiProcessGone once the API process is gone. A plain PUSH send blocks forever
    once a dead reader's queue is full (SNDHWM), which would leave the core orphaned mid-run."""
    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            if os.getppid() != parent:
                raise ApiProcessGone from None
            sock.poll(_PARENT_CHECK_MS, zmq.POLLOUT)


@dataclass
class CoreAddresses:
    inputs: str  # API -> core
    outputs: str  # core -> API


def load_plugins() -> None:
    """Call each ``module:function`` in $HYBRIDSERVE_PLUGINS (comma-separated) in this process, the way
    vLLM's plugins run in every worker: extensions, instrumentation, fault injection for tests."""
    for spec in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
        module, _, name = spec.strip().partition(":")
        getattr(importlib.import_module(module), name)()


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, num_threads: int, log_level: int) -> None:
    """Process entry point; exits 0 on shutdown, 1 when the engine failed."""
    # Ctrl-C in a terminal signals the whole process group: the API process drains and then stops this
    # core (Shutdown, or SIGTERM / SIGKILL), which must not die first under its in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(addresses.inputs)
    outputs.connect(addresses.outputs)
    status, parent = 1, os.getppid()
    try:
        load_plugins()
        core = EngineCore(config)
        core.warmup()
        send_while_parent_lives(outputs, encode(_ready(core)), parent)
        status = _core_loop(core, inputs, outputs).run()
    except ApiProcessGone:
        log.error("the API process is gone; exiting")
    except BaseException as exc:  # the API process must hear why, then this process exits non-zero
        log.exception("the engine core failed")
        with contextlib.suppress(ApiProcessGone):
            send_while_parent_lives(outputs, encode(EngineFailed(f"{type(exc).__name__}: {exc}")), parent)
    finally:
        outputs.close(linger=2000)
        inputs.close(linger=0)
        ctx.term()
    sys.exit(status)


def _core_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> CoreLoop:
    if core.group is None:
        return CoreLoop(core, inputs, outputs)
    from hybridserve.distributed.step_sync import StepSync
    from hybridserve.engine.core.dp_loop import DataParallelCoreLoop  # it builds on CoreLoop

    return DataParallelCoreLoop(core, inputs, outputs, StepSync(core.group))


def _ready(core: EngineCore) -> EngineReady:
    return EngineReady(
        limits=core.limits,
        device=str(core.device),
        dtype=str(core.dtype).removeprefix("torch."),
        cache_bytes=core.plan.total_bytes,
        num_cache_groups=len(core.plan.groups),
        snapshot=core.snapshot(),
    )


class CoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent = os.getppid()

    def send(self, message: CoreOutput) -> None:
        send_while_parent_lives(self.outputs, encode(message), self.parent)

    def run(self) -> int:
        """Until Shutdown (-> 0) or the API process is gone (-> 1); engine failures raise."""
        while True:
            busy = self.core.has_unfinished_requests()
            handoff = self.core.handoff_busy  # a KV handoff progresses between steps: poll it often
            if not busy and not self.inputs.poll(_HANDOFF_POLL_MS if handoff else _PARENT_CHECK_MS):
                if os.getppid() != self.parent:
                    log.error("the API process is gone; exiting")
                    return 1
                if not handoff:
                    continue
            handled = self._drain()
            if handled is None:
                return 0
            events = self.core.handoff_events
            step = self.core.step() if self.core.has_unfinished_requests() or self.core.handoff_busy else []
            if step or handled or self.core.handoff_events != events:
                self.send(StepOutputs(step, self.core.snapshot()))

    def _drain(self) -> int | None:
        """Apply every queued message; -> how many, or None on Shutdown."""
        handled = 0
        while True:
            try:
                data = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            message = decode_input(data)
            if isinstance(message, Shutdown):
                return None
            self._apply(message)
            handled += 1

    def _apply(self, message: CoreInput) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, FinishRequests):
            for request_id in message.request_ids:
                self.core.finish_request(request_id, message.reason, message.stop_reason)
        elif isinstance(message, UtilityCall):
            self._call(message)

    def _add(self, message: AddRequest) -> None:
        request = Request(
            message.request_id,
            message.prompt_token_ids,
            message.params,
            prompt=message.prompt,
            remote_decode=message.remote_decode,
            remote_prefill=message.remote_prefill,
        )
        try:
            self.core.add_request(request)
        except RequestRejected as exc:
            self.send(Rejected(message.request_id, str(exc), exc.code, exc.param))

    def _call(self, message: UtilityCall) -> None:
        error = None
        if message.method not in _UTILITIES:
            error = f"unknown utility {message.method!r}"
        else:
            try:
                getattr(self.core, message.method)()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self.send(UtilityResult(message.call_id, error))


_UTILITIES = frozenset({"reset_prefix_cache"})
