"""Run a function on N spawned ranks (one process each) and collect what each returns; reap them all."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch

RankFn = Callable[..., Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _main(fn: RankFn, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, world_size, port, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: RankFn, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, port, *args)`` on every rank; -> their results by rank, or raise with the
    failing rank's traceback. Every process is joined (or killed) before this returns."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_main, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        got: dict[int, Any] = {}
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(world_size)]
    except queue.Empty as exc:
        raise AssertionError(f"ranks did not finish within {timeout_s:.0f} s") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
