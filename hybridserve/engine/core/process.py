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
import threading
from dataclasses import dataclass

import torch
import zmq

from hybridserve.config import EngineConfig
from hybridserve.distributed.step_sync import StepSync
from hybridserve.engine.core.dp_loop import DataParallelCoreLoop
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.core.loop import ApiProcessGone, CoreLoop, send_while_parent_lives
from hybridserve.engine.messages import EngineFailed, EngineReady, encode

log = logging.getLogger("hybridserve.engine")

PLUGINS_ENV = "HYBRIDSERVE_PLUGINS"


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
        core = EngineCore(config, own_process=True)
        background = core.compiles_in_background
        if background:
            core.runner.graphs.start_gating()  # steps take a compiled part only once it is ready
        else:
            core.grammar_warm_up = core.structured.start_warm_up(import_in_thread=True)
            core.warmup()
        send_while_parent_lives(outputs, encode(_ready(core)), parent)
        loop = _core_loop(core, inputs, outputs)
        status = _run_beside_compile(core, loop) if background else loop.run()
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


def _run_beside_compile(core: EngineCore, loop: CoreLoop) -> int:
    """The core loop in a thread while this, the main thread, warms up the grammar compiler (xgrammar's
    import: seconds of Python) and compiles the graphs: only the main thread can be paused (by a signal)
    for each step (``engine/worker/compile_share.py``). Once the loop ends, the compile is abandoned;
    the loop's status or exception is this function's."""
    outcome: list[int | BaseException] = []

    def run() -> None:
        try:
            outcome.append(loop.run())
        except BaseException as exc:  # re-raised in the main thread
            outcome.append(exc)
        finally:
            core.runner.compile_share.abandon()

    thread = threading.Thread(target=run, name="core-loop", daemon=True)
    with core.runner.compile_share.compiling():  # entered first: the loop's first step pauses it too
        thread.start()
        if core.structured.has_tokenizer and not core.runner.compile_share.abandoned:
            core.structured.warm_up()
        core.runner.warm_beside_steps()
    thread.join()
    if isinstance(result := outcome[0], BaseException):
        raise result
    return result


def _core_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> CoreLoop:
    if core.group is None:
        return CoreLoop(core, inputs, outputs)
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
