"""CoreLoop: one engine core's busy loop of (apply the API process's messages, step, send outputs)."""

from __future__ import annotations

import logging
import os

import zmq

from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.messages import (
    AddRequest,
    CoreInput,
    CoreOutput,
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
PARENT_CHECK_MS = 1000
HANDOFF_POLL_MS = 1


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
            sock.poll(PARENT_CHECK_MS, zmq.POLLOUT)


class CoreLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent = os.getppid()
        self._compiled_sent = 0  # compiled parts ready when the API process last heard

    def send(self, message: CoreOutput) -> None:
        send_while_parent_lives(self.outputs, encode(message), self.parent)

    def run(self) -> int:
        """Until Shutdown (-> 0) or the API process is gone (-> 1); engine failures raise."""
        while True:
            busy = self.core.has_unfinished_requests()
            handoff = self.core.handoff_busy  # a KV handoff progresses between steps: poll it often
            if not busy and not self.inputs.poll(HANDOFF_POLL_MS if handoff else PARENT_CHECK_MS):
                if os.getppid() != self.parent:
                    log.error("the API process is gone; exiting")
                    return 1
                self._tell_compiled()
                if not handoff:
                    continue
            handled = self._drain()
            if handled is None:
                return 0
            events = self.core.handoff_events
            step = self.core.step() if self.core.has_unfinished_requests() or self.core.handoff_busy else []
            if step or handled or self.core.handoff_events != events:
                self.send(StepOutputs(step, self.core.snapshot()))

    def _tell_compiled(self) -> None:
        """An idle core still tells the API process (``/metrics``) when a compiled part became ready."""
        graphs = self.core.runner.graphs
        ready = len(graphs.ready_after) + (graphs.full_speed_after is not None)
        if ready != self._compiled_sent:
            self._compiled_sent = ready
            self.send(StepOutputs([], self.core.snapshot()))

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
