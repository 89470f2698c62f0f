"""Prefill-heavy mixed load: co-located (one server, 2 threads) vs 1 prefill + 1 decode (1 thread each).

Short requests decode while long prompts keep arriving. Reports decode TPOT p50/p99 (short requests),
TTFT p50/p99 (each kind), output throughput, and the handoff bytes and time per request by cache group
(the decode worker's /metrics). Every number comes from one run of this script.

    python benchmarks/disagg.py --checkpoint hybridserve/assets/austen-v4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybridserve.bench.server_process import wait_healthy


@dataclass
class Result:
    kind: str
    ttft: float
    tpot: float | None
    tokens: int


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    handoff: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybridserve.cli", *args, "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL)


def _serve(checkpoint: str, threads: int, *extra: str) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    flags = ["serve", "--model", checkpoint, "--num-threads", str(threads), "--max-num-seqs", "32", *extra]
    return f"http://127.0.0.1:{port}", _spawn(flags, port)


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _one(
    client: httpx.AsyncClient, url: str, model: str, kind: str, prompt: list[int], n: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                assert "error" not in data, data
                stamps.append(time.monotonic())
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return Result(kind, stamps[0] - start, tpot, len(stamps))


async def _workload(url: str, model: str, args: argparse.Namespace, vocab: int) -> tuple[list[Result], float]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()
        short = [
            _one(client, url, model, "short", prompt(args.short_tokens), args.max_tokens)
            for _ in range(args.short)
        ]
        tasks = [asyncio.create_task(c) for c in short]
        for _ in range(args.long):
            await asyncio.sleep(args.long_every)
            tasks.append(asyncio.create_task(_one(client, url, model, "long", prompt(args.long_tokens), 4)))
        results = await asyncio.gather(*tasks)
        return list(results), time.monotonic() - start


def _handoff(url: str, requests: int) -> dict[str, Any]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("hybridserve_kv_handoff"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    n = max(values.get("hybridserve_kv_handoff_transfers_total", 0.0), 1.0)
    by_group = {
        k.split('"')[1]: v / n
        for k, v in values.items()
        if k.startswith("hybridserve_kv_handoff_bytes_total{")
    }
    return {
        "transfers": values.get("hybridserve_kv_handoff_transfers_total", 0.0),
        "requests": requests,
        "bytes_per_request_by_group": by_group,
        "ms_per_request": 1000 * values.get("hybridserve_kv_handoff_seconds_total", 0.0) / n,
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def _summary(run: Run) -> dict[str, Any]:
    tpot = [r.tpot for r in run.results if r.kind == "short" and r.tpot is not None]
    out: dict[str, Any] = {"name": run.name, "wall_s": run.wall_s}
    out["tpot_ms_p50"], out["tpot_ms_p99"] = 1000 * _pct(tpot, 0.5), 1000 * _pct(tpot, 0.99)
    for kind in ("short", "long"):
        ttft = [r.ttft for r in run.results if r.kind == kind]
        out[f"ttft_{kind}_ms_p50"], out[f"ttft_{kind}_ms_p99"] = (
            1000 * _pct(ttft, 0.5),
            1000 * _pct(ttft, 0.99),
        )
    out["output_tok_s"] = sum(r.tokens for r in run.results) / run.wall_s
    out["mean_tpot_ms"] = 1000 * statistics.fmean(tpot) if tpot else None
    if run.handoff:
        out["handoff"] = run.handoff
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default="hybridserve/assets/austen-v4")
    parser.add_argument("--short", type=int, default=8, help="short requests, all decoding from the start")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of a short request")
    parser.add_argument("--long", type=int, default=6, help="long prompts arriving while they decode")
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--long-every", type=float, default=0.4, help="seconds between long arrivals")
    parser.add_argument("--out", default="benchmarks/results/disagg.json")
    args = parser.parse_args()
    with open(f"{args.checkpoint}/config.json") as f:
        config = json.load(f)
    model = os.path.basename(os.path.normpath(args.checkpoint))
    runs = []

    url, colocated = _serve(args.checkpoint, 2)
    try:
        wait_healthy(url, timeout=300)
        run = Run("co-located, 2 threads")
        run.results, run.wall_s = asyncio.run(_workload(url, model, args, config["vocab_size"]))
        runs.append(run)
    finally:
        _stop([colocated])

    p_url, prefill = _serve(args.checkpoint, 1, "--disaggregation-mode", "prefill")
    d_url, decode = _serve(args.checkpoint, 1, "--disaggregation-mode", "decode")
    r_port = _free_port()
    router = _spawn(["router", "--prefill", p_url, "--decode", d_url], r_port)
    r_url = f"http://127.0.0.1:{r_port}"
    try:
        for u in (p_url, d_url, r_url):
            wait_healthy(u, timeout=300)
        run = Run("1 prefill + 1 decode, 1 thread each")
        run.results, run.wall_s = asyncio.run(_workload(r_url, model, args, config["vocab_size"]))
        run.handoff = _handoff(d_url, len(run.results))
        runs.append(run)
    finally:
        _stop([router, prefill, decode])

    summaries = [_summary(r) for r in runs]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": summaries}, f, indent=2)
    print(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
