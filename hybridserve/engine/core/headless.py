"""``hybridserve serve --headless``: this host's engine-core ranks of a data-parallel world whose API
process (and rank 0's rendezvous store) runs on the head host at --data-parallel-address."""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import wait
from types import FrameType

from hybridserve.config import EngineConfig
from hybridserve.engine.client.dp_client import DataParallelAddresses, start_ranks, stop_processes

log = logging.getLogger("hybridserve.engine")


def run_headless(config: EngineConfig) -> int:
    """Start ranks ``--data-parallel-start-rank`` .. + ``--data-parallel-size-local``, then wait: 0 once
    every rank has exited cleanly (the head's shutdown), 1 as soon as one fails; SIGTERM stops them."""
    if config.data_parallel_rpc_port is None:
        raise ValueError(
            "--headless needs --data-parallel-rpc-port (and --data-parallel-address) of the head"
        )
    processes = start_ranks(config, DataParallelAddresses.for_config(config, None))
    first = config.data_parallel_start_rank
    log.info(
        "ranks %d..%d connect to the head at %s",
        first,
        first + len(processes) - 1,
        config.data_parallel_address,
    )

    def terminate(sig: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    status = 0
    try:
        pending = list(processes)
        while pending:
            for sentinel in wait([p.sentinel for p in pending]):
                done = next(p for p in pending if p.sentinel == sentinel)
                pending.remove(done)
                done.join()
                if done.exitcode != 0:
                    log.error("%s exited with status %s", done.name, done.exitcode)
                    return 1
    except KeyboardInterrupt:
        status = 1
    finally:
        stop_processes(processes, timeout_s=10)
    return status
