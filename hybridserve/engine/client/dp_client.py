"""DPEngineCoreClient: the API process's end of N data-parallel engine-core ranks.

It starts this host's ranks (others may run elsewhere: ``hybridserve serve --headless``), binds one
output socket they all push to and one input socket per rank, sends each request to the rank its
RankRouter picks (least loaded, or holding the prefix), and hands the API process a
merged view: one snapshot summed over ranks, utility calls answered once every rank has.
With expert parallelism every message to one rank comes with a ``Wake`` to each other rank
(distributed/step_sync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

from hybridserve.config import EngineConfig
from hybridserve.engine.client.core_client import ready_deadline
from hybridserve.engine.client.rank_router import RankRouter
from hybridserve.engine.core.process import CoreAddresses, run_engine_core
from hybridserve.engine.errors import EngineDeadError
from hybridserve.engine.messages import (
    AddRequest,
    CoreOutput,
    EngineFailed,
    EngineReady,
    FinishRequests,
    Rejected,
    Shutdown,
    StepOutputs,
    UtilityResult,
    Wake,
    decode_output,
    encode,
)
from hybridserve.engine.stats import ArenaUsage, EngineSnapshot, PoolUsage
from hybridserve.kv_transfer.records import HandoffStats

log = logging.getLogger("hybridserve.engine")


@dataclasses.dataclass(frozen=True)
class DataParallelAddresses:
    """Where the head listens: ``outputs`` (all ranks push) and ``inputs[r]`` (rank r pulls)."""

    store_port: int
    outputs: str
    inputs: list[str]

    @classmethod
    def for_config(cls, config: EngineConfig, ipc_dir: str | None) -> DataParallelAddresses:
        """TCP ports from --data-parallel-rpc-port when given (several hosts), else IPC in ``ipc_dir``."""
        n, port = config.data_parallel_size, config.data_parallel_rpc_port
        if port is None:
            assert ipc_dir is not None and config.local_ranks == n, (
                "several hosts need --data-parallel-rpc-port"
            )
            return cls(
                free_port(), f"ipc://{ipc_dir}/outputs", [f"ipc://{ipc_dir}/inputs-{r}" for r in range(n)]
            )
        tcp = f"tcp://{config.data_parallel_address}:"
        return cls(port, f"{tcp}{port + 1}", [f"{tcp}{port + 2 + r}" for r in range(n)])

    def for_rank(self, rank: int) -> CoreAddresses:
        return CoreAddresses(self.inputs[rank], self.outputs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(config: EngineConfig, addresses: DataParallelAddresses) -> list[BaseProcess]:
    """Start this host's ranks (``--data-parallel-start-rank`` .. + ``--data-parallel-size-local``)."""
    ctx = multiprocessing.get_context("spawn")
    level = logging.getLogger("hybridserve").getEffectiveLevel()
    processes: list[BaseProcess] = []
    first = config.data_parallel_start_rank
    for rank in range(first, first + config.local_ranks):
        rank_config = dataclasses.replace(
            config, data_parallel_rank=rank, data_parallel_rpc_port=addresses.store_port
        )
        args = (rank_config, addresses.for_rank(rank), torch.get_num_threads(), level)
        process = ctx.Process(target=run_engine_core, args=args, name=f"hybridserve-core-{rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def stop_processes(processes: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        for p in processes:
            if p.is_alive():
                getattr(p, stop)()
        for p in processes:
            p.join(5)


class DPEngineCoreClient:
    """The same interface as EngineCoreClient, over ``config.data_parallel_size`` ranks."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_ranks = config.data_parallel_size
        self._dir = tempfile.mkdtemp(prefix="hybridserve-dp-")
        addresses = DataParallelAddresses.for_config(config, self._dir)
        self._ctx = zmq.Context()
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(addresses.outputs)
        self._inputs = []
        for address in addresses.inputs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(address)
            self._inputs.append(sock)
        self._async_outputs: zmq.asyncio.Socket | None = None
        self.router = RankRouter(self.num_ranks)
        self._results: dict[int, list[UtilityResult]] = {}
        self.processes = start_ranks(config, addresses)
        try:
            self.rank_stats, self.ready = self._wait_ready(config.engine_ready_timeout)
        except BaseException:
            self.close(timeout_s=5)
            raise

    @property
    def process(self) -> BaseProcess:
        return self.processes[0]

    # ---- start -----------------------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> tuple[dict[int, EngineSnapshot], EngineReady]:
        ready: dict[int, EngineReady] = {}
        deadline = ready_deadline(timeout_s)
        while len(ready) < self.num_ranks:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_ranks)) - set(ready))
                raise EngineDeadError(
                    f"engine-core ranks {missing} did not start within {timeout_s:g} s "
                    "(--engine-ready-timeout; 0: no limit)"
                )
            if self._outputs.poll(100):
                message = decode_output(self._outputs.recv())
                if isinstance(message, EngineReady):
                    ready[message.snapshot.dp_rank] = message
                elif isinstance(message, EngineFailed):
                    raise EngineDeadError(f"an engine-core rank could not start: {message.message}")
            self.check_alive()
        stats = {r: m.snapshot for r, m in ready.items()}
        first = ready[0]
        merged = msgspec.structs.replace(
            first, cache_bytes=sum(m.cache_bytes for m in ready.values()), snapshot=merge_snapshots(stats)
        )
        return stats, merged

    def check_alive(self) -> None:
        for rank, p in enumerate(self.processes, self.config.data_parallel_start_rank):
            if not p.is_alive():
                raise EngineDeadError(f"engine-core rank {rank} exited with status {p.exitcode}")

    # ---- to the ranks ------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Route ``message``: a new request to one rank, finishes to their owners, the rest to all."""
        if isinstance(message, AddRequest):
            self._send_to(self.router.assign(message.request_id, message.prompt_token_ids), message)
        elif isinstance(message, FinishRequests):
            self._send_finishes(message)
        else:
            for rank in range(self.num_ranks):
                self._push(rank, message)

    def _send_finishes(self, message: FinishRequests) -> None:
        """To each request's owner; ids no rank owns any more (a prefill side's handed-off requests,
        whose blocks wait on the rank that ran them) go to every rank, which ignores those it lacks."""
        owned = self.router.by_owner(message.request_ids)
        for rank, ids in owned.items():
            self._send_to(rank, msgspec.structs.replace(message, request_ids=ids))
        known = {r for ids in owned.values() for r in ids}
        unowned = [r for r in message.request_ids if r not in known]
        if unowned:
            for rank in range(self.num_ranks):
                self._push(rank, msgspec.structs.replace(message, request_ids=unowned))

    def _send_to(self, rank: int, message: Any) -> None:
        self._push(rank, message)
        if self.config.expert_parallel:
            for other in range(self.num_ranks):
                if other != rank:
                    self._push(other, Wake())

    def _push(self, rank: int, message: Any) -> None:
        try:
            self._inputs[rank].send(encode(message), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineDeadError(f"engine-core rank {rank} is not connected") from exc

    # ---- from the ranks ----------------------------------------------------------------------------
    async def recv(self) -> CoreOutput:
        if self._async_outputs is None:
            self._async_outputs = zmq.asyncio.Socket.shadow(self._outputs.underlying)
        while True:
            merged = self._merge(decode_output(await self._async_outputs.recv()))
            if merged is not None:
                return merged

    def recv_blocking(self, timeout_s: float) -> CoreOutput:
        """The next output, for callers without an event loop; EngineDeadError if a rank is gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(100):
                merged = self._merge(decode_output(self._outputs.recv()))
                if merged is not None:
                    return merged
            else:
                self.check_alive()
        raise EngineDeadError(f"no output from the engine-core ranks within {timeout_s:.0f} s")

    def _merge(self, message: CoreOutput) -> CoreOutput | None:
        if isinstance(message, StepOutputs):
            self.rank_stats[message.snapshot.dp_rank] = message.snapshot
            for out in message.outputs:
                if out.finish_reason is not None:
                    self.router.forget(out.request_id)
            return StepOutputs(message.outputs, merge_snapshots(self.rank_stats))
        if isinstance(message, Rejected):
            self.router.forget(message.request_id)
        if isinstance(message, UtilityResult):
            return self._utility_result(message)
        return message

    def _utility_result(self, result: UtilityResult) -> UtilityResult | None:
        results = self._results.setdefault(result.call_id, [])
        results.append(result)
        if len(results) < self.num_ranks:
            return None
        del self._results[result.call_id]
        errors = [r.error for r in results if r.error is not None]
        return UtilityResult(result.call_id, errors[0] if errors else None)

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[int | None], None]) -> None:
        """Call ``callback(exit code)`` in ``loop`` when any of this host's ranks ends."""
        for p in self.processes:

            def exited(p: BaseProcess = p) -> None:
                self.stop_watching(loop)
                p.join(timeout=1)
                callback(p.exitcode)

            loop.add_reader(p.sentinel, exited)

    def stop_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        for p in self.processes:
            loop.remove_reader(p.sentinel)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to stop, then make sure this host's have. Idempotent."""
        if self._ctx.closed:
            return
        with contextlib.suppress(zmq.ZMQError, EngineDeadError):
            self.send(Shutdown())
        stop_processes(self.processes, timeout_s)
        self._outputs.close(linger=0)
        for sock in self._inputs:
            sock.close(linger=500)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def merge_snapshots(stats: dict[int, EngineSnapshot]) -> EngineSnapshot:
    """Every rank's counts summed; pools summed by group; tokens per expert joined; compile readiness the
    slowest rank's."""
    merged = EngineSnapshot()
    for s in stats.values():
        for name in (
            "num_running",
            "num_waiting",
            "prompt_tokens",
            "prefix_hit_tokens",
            "num_preemptions",
            "generation_tokens",
            "steps",
            "failed_steps",
            "spec_num_drafts",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
            "spec_plain_steps",
        ):
            setattr(merged, name, getattr(merged, name) + getattr(s, name))
        for group, pool in s.kv_blocks.items():
            total = merged.kv_blocks.setdefault(group, PoolUsage(0, 0, 0))
            total.used, total.total, total.cached, total.evicted = (
                total.used + pool.used,
                total.total + pool.total,
                total.cached + pool.cached,
                total.evicted + pool.evicted,
            )
            total.pages += pool.pages
        merged.arena = _merge_arenas(merged.arena, s.arena)
        merged.collective_s += s.collective_s
        for expert, n in s.expert_tokens.items():
            merged.expert_tokens[expert] = merged.expert_tokens.get(expert, 0) + n
        for path, n in s.steps_by_path.items():
            merged.steps_by_path[path] = merged.steps_by_path.get(path, 0) + n
        for path, n in s.drafts_by_path.items():
            merged.drafts_by_path[path] = merged.drafts_by_path.get(path, 0) + n
        for part, t in s.compiled_ready_s.items():  # the slowest rank's
            merged.compiled_ready_s[part] = max(merged.compiled_ready_s.get(part, 0.0), t)
        merged.spec_accepted_per_pos = _add_lists(merged.spec_accepted_per_pos, s.spec_accepted_per_pos)
        merged.handoff = _merge_handoffs(merged.handoff, s.handoff)
    speeds = [s.full_speed_s for s in stats.values()]
    merged.full_speed_s = max(t for t in speeds if t is not None) if speeds and None not in speeds else None
    return merged


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


def _merge_handoffs(total: HandoffStats | None, rank: HandoffStats | None) -> HandoffStats | None:
    """Every rank of a disaggregated side hands off on its own: counts, bytes and seconds add up."""
    if rank is None or total is None:
        return total if rank is None else dataclasses.replace(rank, bytes_by_group=dict(rank.bytes_by_group))
    for name in ("transfers", "failed", "expired", "seconds", "events", "corrupt"):
        setattr(total, name, getattr(total, name) + getattr(rank, name))
    for group, n in rank.bytes_by_group.items():
        total.bytes_by_group[group] = total.bytes_by_group.get(group, 0) + n
    return total


def _merge_arenas(total: ArenaUsage | None, rank: ArenaUsage | None) -> ArenaUsage | None:
    """Every rank has an arena of its own: pages add up (page sizes are equal, one plan per rank)."""
    if rank is None or total is None:
        return total if rank is None else dataclasses.replace(rank)
    return ArenaUsage(
        rank.page_bytes,
        total.pages_total + rank.pages_total,
        total.pages_free + rank.pages_free,
        total.pages_parked + rank.pages_parked,
        total.pages_reclaimed + rank.pages_reclaimed,
    )
