"""EngineCoreClient: starts the engine-core process and carries messages to and from it over ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq
import zmq.asyncio

from hybridserve.config import EngineConfig
from hybridserve.engine.core.process import CoreAddresses, run_engine_core
from hybridserve.engine.errors import EngineDeadError
from hybridserve.engine.messages import (
    CoreOutput,
    EngineFailed,
    EngineReady,
    Shutdown,
    decode_output,
    encode,
)

log = logging.getLogger("hybridserve.engine")


def ready_deadline(timeout_s: float) -> float:
    """``time.monotonic()`` past which a starting engine core has failed (0 s: never)."""
    return time.monotonic() + timeout_s if timeout_s > 0 else math.inf


class EngineCoreClient:
    """The API process's end of the engine core: ``send`` messages, ``recv`` outputs (in the event loop).

    The constructor blocks until the core has loaded the model (or raises EngineDeadError).
    """

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="hybridserve-")
        addresses = CoreAddresses(f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs")
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)  # never block the event loop; the core drains every step
        self._inputs.bind(addresses.inputs)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(addresses.outputs)
        self._async_outputs: zmq.asyncio.Socket | None = None
        args = (
            config,
            addresses,
            torch.get_num_threads(),
            logging.getLogger("hybridserve").getEffectiveLevel(),
        )
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=args, name="hybridserve-core", daemon=True
        )
        self.process.start()
        try:
            self.ready = self._wait_ready(config.engine_ready_timeout)
        except BaseException:
            self.close(timeout_s=5)
            raise

    def _wait_ready(self, timeout_s: float) -> EngineReady:
        deadline = ready_deadline(timeout_s)
        while time.monotonic() < deadline:
            if self._outputs.poll(100):
                message = decode_output(self._outputs.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineFailed):
                    raise EngineDeadError(f"the engine core could not start: {message.message}")
            elif not self.process.is_alive():
                raise EngineDeadError(f"the engine-core process exited with status {self.process.exitcode}")
        raise EngineDeadError(
            f"the engine core did not start within {timeout_s:g} s (--engine-ready-timeout; 0: no limit)"
        )

    def send(self, message: Any) -> None:
        """Queue ``message`` for the core; never blocks (a PUSH with no peer would block forever)."""
        try:
            self._inputs.send(encode(message), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineDeadError("the engine core is not connected") from exc

    async def recv(self) -> CoreOutput:
        if self._async_outputs is None:
            self._async_outputs = zmq.asyncio.Socket.shadow(self._outputs.underlying)
        return decode_output(await self._async_outputs.recv())

    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[int | None], None]) -> None:
        """Call ``callback(exit code)`` in ``loop`` when the core process ends, whatever the cause."""

        def exited() -> None:
            loop.remove_reader(self.process.sentinel)
            self.process.join(timeout=1)
            callback(self.process.exitcode)

        loop.add_reader(self.process.sentinel, exited)

    def stop_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.process.sentinel)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the core to stop, then make sure it has: terminate, kill. Idempotent."""
        if self._ctx.closed:
            return
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                self.send(Shutdown())
            self.process.join(timeout_s)
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self.process.join(5)
        self._outputs.close(linger=0)
        self._inputs.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
