"""The engine-core loop of one expert-parallel rank: all ranks step together, or all sleep.

Each round: apply the queued messages, agree (one all-reduce) on whether anyone has work, catch up
with the messages other ranks have already applied, then step; a rank with nothing scheduled runs a
dummy step so that every MoE layer's collectives complete. Ranks block on their input only when the
agreement says nobody can be woken alone (distributed/step_sync.py). While a KV handoff is in flight on
any rank (a disaggregated side), every rank polls its own handoff between rounds without stepping; an
import that finishes is work the next agreement makes every rank step for.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
import zmq

from hybridserve.distributed.step_sync import StepSync
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.core.loop import HANDOFF_POLL_MS, PARENT_CHECK_MS, CoreLoop
from hybridserve.engine.errors import EngineDeadError
from hybridserve.engine.messages import Shutdown, StepOutputs, decode_input
from hybridserve.engine.stats import EngineSnapshot

log = logging.getLogger("hybridserve.engine")


class DataParallelCoreLoop(CoreLoop):
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, sync: StepSync) -> None:
        super().__init__(core, inputs, outputs)
        self.sync = sync
        self.seq = 0  # messages applied, Wakes included
        self.stopping = False
        self.catch_up_timeout_ms = int(sync.group.timeout_s * 1000)

    def run(self) -> int:
        idle, polling = True, False
        while True:
            if idle and not self.inputs.poll(PARENT_CHECK_MS):
                if os.getppid() != self.parent or not self._world_alive():
                    log.error("the process that started this rank, or rank 0, is gone; exiting")
                    return 1
                continue
            if polling:  # only handoffs in flight: no step to run, so give them (and inputs) a moment
                self.inputs.poll(HANDOFF_POLL_MS)
            events = self.core.handoff_events
            handled = self._receive(block=False)
            self.core.poll_handoff()
            agreed = self.sync.agree(
                self.seq, self.core.has_unfinished_requests(), self.stopping, self.core.handoff_busy
            )
            if agreed.stop:
                return 0
            while self.seq < agreed.target_seq:
                handled += self._receive(block=True)
            step = self._step() if agreed.any_work else []
            if step or handled or self.core.handoff_events != events:
                self.send(StepOutputs(step, self._snapshot()))
            idle, polling = agreed.idle, not agreed.any_work and agreed.any_handoff

    def _world_alive(self) -> bool:
        """Whether rank 0's rendezvous store still answers (a headless host's ranks see the head die)."""
        try:
            self.sync.group.store.check(["hybridserve/alive"])
        except (RuntimeError, dist.DistError):
            return False
        return True

    def _snapshot(self) -> EngineSnapshot:
        snapshot = self.core.snapshot()
        snapshot.collective_s += self.sync.comm_s
        return snapshot

    def _step(self) -> list:
        steps, failed = self.core.stats.steps, self.core.stats.failed_steps
        outputs = self.core.step() if self.core.has_unfinished_requests() else []
        if self.core.stats.failed_steps != failed:
            # It stopped somewhere inside the forward: the ranks' collectives no longer pair up.
            raise EngineDeadError(f"a step failed on expert-parallel rank {self.sync.group.rank}")
        if self.core.stats.steps == steps:  # nothing scheduled here: the others still need our MoE
            self.core.execute_dummy_batch()
        return outputs

    def _receive(self, block: bool) -> int:
        """Apply queued messages (with ``block``, wait for at least one); -> how many."""
        handled = 0
        while True:
            if block and not handled and not self.inputs.poll(self.catch_up_timeout_ms):
                raise EngineDeadError(
                    f"rank {self.sync.group.rank} waited {self.catch_up_timeout_ms / 1000:.0f} s for a "
                    "message the other ranks have already received"
                )
            try:
                data = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            message = decode_input(data)
            self.seq += 1
            handled += 1
            if isinstance(message, Shutdown):
                self.stopping = True
            else:
                self._apply(message)
