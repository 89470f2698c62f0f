"""Wall time of an eager prefill step (or a mixed one: prefill chunks beside decoding requests).

    python benchmarks/prefill_step.py --prompt-len 128 --budget 512              # 4 prompts a step
    python benchmarks/prefill_step.py --prompt-len 128 --budget 512 --decoding 48 # + 48 decodes a step
    python benchmarks/prefill_step.py ... --compile-mhc                           # mHC tail compiled
    python benchmarks/prefill_step.py ... --compile-prefill                       # the whole step compiled

Loads the offline engine (``LLM``, ``--enforce-eager``, prefix caching off) on ``--model``. Each measured
step is scheduled with fresh random prompts filling the token budget next to ``--decoding`` requests
that are already decoding (they never finish). Reports the median and p10 wall ms of ``--steps`` steps
after ``--warmup`` ones. The script only uses ``LLM``, ``SamplingParams`` and ``engine.step()``, so it
runs against an older checkout too (``PYTHONPATH=<checkout>``) for before/after tables.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from hybridserve.engine.llm import LLM
from hybridserve.engine.output_processor import OutputProcessor
from hybridserve.engine.request import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hybridserve/assets/austen-v4")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--decoding", type=int, default=0, help="requests decoding beside the prefill")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-mhc", action="store_true", help="the eager steps' mHC tail compiled")
    p.add_argument("--compile-prefill", action="store_true", help="the step through its compiled graph")
    p.add_argument("--out", default=None, help="JSON result file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        enable_prefix_caching=False,
        enforce_eager=not args.compile_prefill,
        max_num_batched_tokens=args.budget,
        max_num_seqs=max(64, args.decoding + args.budget // args.prompt_len + 2),
        **({"compile_prefill": True} if args.compile_prefill else {}),  # older checkouts lack the flag
    )
    if args.compile_prefill:
        llm.engine.warmup()  # the graph compiles before the clock starts
    if args.compile_mhc:
        from hybridserve.layers.hyper_connection import set_compile

        set_compile(True)
    times = _measure(llm, args)
    result = {
        "config": vars(args),
        "median_ms": 1e3 * statistics.median(times),
        "p10_ms": 1e3 * sorted(times)[len(times) // 10],
        "steps_ms": [1e3 * t for t in times],
    }
    print(f"{args.model} prompt {args.prompt_len} budget {args.budget} decoding {args.decoding}: ", end="")
    print(f"median {result['median_ms']:.1f} ms, p10 {result['p10_ms']:.1f} ms a step")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def _measure(llm: LLM, args: argparse.Namespace) -> list[float]:
    engine, rng = llm.engine, random.Random(0)
    processor = OutputProcessor(llm.tokenizer)

    def add(n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            ids = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
            llm._add(llm._request(ids, params), processor)

    add(args.decoding, engine.max_request_tokens - args.prompt_len)  # they never finish here
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()
    per_step = max(1, (args.budget - args.decoding) // args.prompt_len)
    times = []
    for _ in range(args.warmup + args.steps):
        add(per_step, 1)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) > args.decoding:
            engine.step()
    return times[args.warmup :]


if __name__ == "__main__":
    main()
