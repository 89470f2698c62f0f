"""Arrival processes (all at once, fixed concurrency, Poisson) driving one endpoint."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

import httpx
from tqdm import tqdm

from hybridserve.bench.client import Endpoint, RequestResult, send
from hybridserve.bench.workloads import BenchRequest


async def run_workload(
    ep: Endpoint,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    warmup: int = 0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send the first ``warmup`` requests one by one (not measured), then the rest; -> (results, seconds).

    Warm-up prompts are never measured, so a prefix cache cannot profit from having seen them.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        for r in requests[:warmup]:
            await send(client, ep, r.prompt, r.output_len, r.messages)
        requests = requests[warmup:]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=not progress)
        start = time.perf_counter()
        units = _units(requests)
        tasks = []
        rng = random.Random(seed)
        for i, unit in enumerate(units):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(_run_unit(client, ep, unit, gate, bar)))
        results = [r for group in await asyncio.gather(*tasks) for r in group]
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def _units(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    """A unit arrives as one: a single request, or a whole multi-turn conversation."""
    conversations: dict[int, list[BenchRequest]] = defaultdict(list)
    units: list[list[BenchRequest]] = []
    for r in requests:
        if r.conversation < 0:
            units.append([r])
        else:
            if r.conversation not in conversations:
                units.append(conversations[r.conversation])
            conversations[r.conversation].append(r)
    return units


async def _run_unit(
    client: httpx.AsyncClient,
    ep: Endpoint,
    unit: list[BenchRequest],
    gate: asyncio.Semaphore | None,
    bar: tqdm,
) -> list[RequestResult]:
    results = []
    history: list[dict[str, str]] = []
    for r in unit:
        messages = history + r.messages if r.messages else []
        if gate is not None:
            async with gate:
                res = await send(client, ep, r.prompt, r.output_len, messages, r.prompt_len)
        else:
            res = await send(client, ep, r.prompt, r.output_len, messages, r.prompt_len)
        results.append(res)
        bar.update(1)
        if r.messages:
            history = [*messages, {"role": "assistant", "content": res.text}]
    return results
