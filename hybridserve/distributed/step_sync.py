"""DP-attention step agreement: before each step every rank says how many messages it has applied,
whether it has work and whether it was told to stop; one all-reduce makes that common knowledge.

The API process sends every rank the same number of messages (the real one to one rank, a ``Wake`` to
the others), so "every rank applied ``max`` messages" is a state all ranks reach. Ranks sleep on their
input only after a round in which nobody had work *and* all had applied the same messages: then no
rank can be woken alone, and no rank waits in a collective for one that sleeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridserve.distributed.group import ProcessGroup


@dataclass(frozen=True)
class StepAgreement:
    any_work: bool  # some rank has requests: every rank steps (a dummy step where it has none)
    stop: bool  # some rank was told to shut down: all stop now
    target_seq: int  # messages every rank must have applied before the next round
    settled: bool  # all ranks had applied the same messages
    any_handoff: bool = False  # some rank has a KV handoff in flight: nobody may block for long

    @property
    def idle(self) -> bool:
        """Nobody has work and nobody can be woken alone: all ranks may block on their input."""
        return not self.any_work and not self.any_handoff and self.settled


class StepSync:
    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.comm_s = 0.0  # time spent in the agreement's all-reduce

    def agree(self, seq: int, has_work: bool, stop: bool, handoff: bool = False) -> StepAgreement:
        """``handoff``: a KV handoff of this rank's is in flight; it progresses without a step, but a
        finished import becomes work that every rank must step for, so nobody may sleep meanwhile."""
        flags = torch.tensor([seq, -seq, int(has_work), int(stop), int(handoff)], dtype=torch.long)
        start = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group.cpu_group)
        self.comm_s += time.perf_counter() - start
        high, neg_low, work, stopped, handoff_on = flags.tolist()
        return StepAgreement(bool(work), bool(stopped), high, high == -neg_low, bool(handoff_on))
