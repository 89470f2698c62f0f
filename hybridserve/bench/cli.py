"""``hybridserve bench serve``: build the workload, run it (once or per concurrency), report."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx

from hybridserve.bench.client import Endpoint
from hybridserve.bench.metrics import BenchSummary, Slo, format_table, summarize
from hybridserve.bench.runner import run_workload
from hybridserve.bench.spec_decode import scrape_counters
from hybridserve.bench.workloads import (
    BenchRequest,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from hybridserve.tokenizer import Tokenizer, load_tokenizer


def _workload(args: argparse.Namespace, tokenizer: Tokenizer | None, seed: int) -> list[BenchRequest]:
    """Warm-up requests first, then the measured ones: all distinct prompts drawn from ``seed``."""
    n = args.num_prompts + args.warmup
    if args.workload == "shared-prefix":
        per = max(1, -(-n // args.num_prefixes))
        return shared_prefix_workload(
            seed, args.num_prefixes, per, args.prefix_len, args.input_len, args.output_len, tokenizer
        )[:n]
    if args.workload == "multi-turn":  # warm-up does not apply: turns depend on earlier answers
        conversations = max(1, -(-args.num_prompts // args.turns))
        turns = multi_turn_workload(
            seed, conversations, args.turns, args.input_len, args.output_len, tokenizer
        )
        return turns[: args.num_prompts]
    return random_workload(seed, n, args.input_len, args.output_len, args.range_ratio, tokenizer)


def _model_name(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "soak":
        from hybridserve.bench.soak import run_soak

        return run_soak(args)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    ep = Endpoint(
        args.base_url, _model_name(args), args.endpoint, args.api_key, not args.no_ignore_eos, extra
    )
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    warm = 0 if args.workload == "multi-turn" else args.warmup
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else [args.max_concurrency]
    slo = Slo.parse(args.slo)
    points: list[tuple[int, BenchSummary]] = []
    for i, level in enumerate(levels):
        # Fresh prompts per level: a server's prefix cache must not profit from an earlier level.
        requests = _workload(args, tokenizer, args.seed + 7919 * i)
        before = scrape_counters(args.base_url, args.api_key)
        results, duration = asyncio.run(
            run_workload(
                ep,
                requests,
                args.request_rate,
                level,
                args.seed,
                warmup=warm,
                progress=not args.no_progress,
            )
        )
        config = {
            "label": args.label,
            "model": ep.model,
            "endpoint": ep.kind,
            "workload": args.workload,
            "num_prompts": len(requests) - warm,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
            "max_concurrency": level,
            "seed": args.seed + 7919 * i,
        }
        summary = summarize(results, duration, slo, config)
        after = scrape_counters(args.base_url, args.api_key)
        if before is not None and after is not None:
            summary.spec_decode = (after - before).summary()
        print(f"\n== {args.label}: concurrency {level or 'unbounded'} ==\n{format_table(summary)}")
        points.append((level or len(requests), summary))
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([s.to_dict() for _, s in points], indent=2))
    if args.plot:
        from hybridserve.bench.plot import plot_sweep

        for p in plot_sweep(points, Path(args.plot), args.label):
            print(f"wrote {p}")
    failed = sum(s.failed for _, s in points)
    return 1 if failed and not any(s.completed for _, s in points) else 0
