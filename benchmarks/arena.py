"""The cache arena vs the fixed split on the same cache memory, long-prompt and short-prompt workloads.

    python benchmarks/arena.py --threads 1 --out benchmarks/results/arena.json

For each workload the offline engine (``LLM``, greedy, EOS ignored, prefix caching off so that every
prompt is computed) runs the same seeded requests with ``--cache-layout fixed`` (each group a fixed share
of ``--kv-cache-memory`` at start-up: window groups sized for ``--max-num-seqs`` requests, then
``--window-cache-share`` of the rest, history groups the remainder) and with ``--cache-layout arena``
(one byte arena of the same memory). Reported per run: the most requests running at once (measured,
step by step), what the plan says fits at once, preemptions, steps and time. Both layouts must give the
same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.plan import CachePlanError
from hybridserve.config import default_model_path
from hybridserve.engine.core.scheduler import SchedulerOutput

WORKLOADS = {"long": (512, 128, 16), "short": (32, 32, 64)}  # prompt tokens, new tokens, requests


def most_running(llm: LLM) -> list[int]:
    """A one-item list that keeps the most requests any step ran."""
    peak = [0]
    schedule = llm.engine.scheduler.schedule

    def counting() -> SchedulerOutput:
        out = schedule()
        peak[0] = max(peak[0], len(out.scheduled))
        return out

    llm.engine.scheduler.schedule = counting  # type: ignore[method-assign]
    return peak


def run(args: argparse.Namespace, workload: str, layout: str) -> tuple[dict[str, Any], list[list[int]]]:
    prompt_len, new, n = WORKLOADS[workload]
    n = args.num_requests or n
    llm = LLM(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        cache_layout=layout,
        block_tokens=args.block_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    vocab = llm.engine.model.cfg.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    peak = most_running(llm)
    t = time.perf_counter()
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    seconds = time.perf_counter() - t
    plan = llm.engine.plan
    assert llm.engine.pools.all_free()
    return {
        "workload": workload,
        "layout": layout,
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "requests": n,
        "cache_bytes": plan.total_bytes,
        "page_bytes": plan.arena.page_bytes if plan.arena is not None else None,
        "plan_fits_at_once": plan.requests_that_fit(prompt_len + new),
        "most_running": peak[0],
        "preemptions": llm.engine.scheduler.num_preemptions,
        "steps": llm.engine.stats.steps,
        "seconds": seconds,
    }, tokens


def report(row: dict[str, Any]) -> None:
    print(
        f"{row['workload']:<6} {row['layout']:<6} cache {row['cache_bytes'] / 2**20:6.1f} MiB  "
        f"plan fits {row['plan_fits_at_once']:>4}  most running {row['most_running']:>3}  "
        f"preemptions {row['preemptions']:>4}  steps {row['steps']:>5}  {row['seconds']:6.1f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--kv-cache-memory", default="12MiB")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--workloads", default="long,short")
    p.add_argument("--num-requests", type=int, help="instead of each workload's own count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for workload in args.workloads.split(","):
        tokens = {}
        for layout in ("fixed", "arena"):
            try:
                row, tokens[layout] = run(args, workload, layout)
            except CachePlanError as refused:  # e.g. a fixed window share for max_num_seqs does not fit
                print(f"{workload:<6} {layout:<6} refused at start-up: {refused}")
                rows.append({"workload": workload, "layout": layout, "refused": str(refused)})
                continue
            report(row)
            rows.append(row)
        if len(tokens) == 2:
            assert tokens["fixed"] == tokens["arena"], f"{workload}: the layouts gave different tokens"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
