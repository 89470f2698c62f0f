"""Preemptions per finished request under a tight KV pool, growth reserve on vs off, in one run.

    python benchmarks/preemption.py --threads 1

The offline engine (``LLM``) runs a seeded workload of mixed prompt lengths and max_tokens (greedy,
EOS ignored) on a pool too small for all requests at once, once with the scheduler's growth reserve
turned off (``reserve_lookahead=0``: admit whenever the first chunk's blocks are free now, the old
behaviour) and once with it on (default: one block of growth kept free per older running request).
Both runs must produce the same tokens. Prints one line per run and writes JSON with ``--out``.
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
from hybridserve.config import default_model_path
from hybridserve.engine.core.scheduler import SchedulerOutput


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded prompts of mixed lengths, each with its own max_tokens."""
    rng = random.Random(args.seed)
    prompts, params = [], []
    for _ in range(args.num_requests):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))])
        params.append(
            SamplingParams(temperature=0, max_tokens=rng.randint(*args.max_tokens), ignore_eos=True)
        )
    return prompts, params


def count_computed_tokens(llm: LLM) -> list[int]:
    """A one-item list that sums the tokens of every scheduled step (recomputation included)."""
    total = [0]
    schedule = llm.engine.scheduler.schedule

    def counting() -> SchedulerOutput:
        out = schedule()
        total[0] += out.num_tokens
        return out

    llm.engine.scheduler.schedule = counting  # type: ignore[method-assign]
    return total


def run(args: argparse.Namespace, reserve: bool) -> tuple[dict[str, Any], list[list[int]]]:
    llm = LLM(
        model=args.model,
        num_blocks=args.num_blocks,
        block_tokens=args.block_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    scheduler = llm.engine.scheduler
    computed = count_computed_tokens(llm)
    if not reserve:
        scheduler.reserve_lookahead = 0
    elif args.lookahead is not None:
        scheduler.reserve_lookahead = args.lookahead
    prompts, params = workload(args, llm.engine.model.cfg.vocab_size)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    finished = sum(o.finished for o in outputs)
    tokens = [o.outputs[0].token_ids for o in outputs]
    row = {
        "reserve": reserve,
        "reserve_lookahead": scheduler.reserve_lookahead,
        "finished": finished,
        "preemptions": scheduler.num_preemptions,
        "preemptions_per_finished": scheduler.num_preemptions / max(finished, 1),
        "steps": llm.engine.stats.steps,
        "computed_tokens": computed[0],
        "output_tokens": sum(len(x) for x in tokens),
        "seconds": seconds,
    }
    row["output_tok_s"] = row["output_tokens"] / seconds
    assert llm.engine.pools.all_free()
    return row, tokens


def report(row: dict[str, Any]) -> None:
    name = f"reserve on ({row['reserve_lookahead']} tokens)" if row["reserve"] else "reserve off"
    print(
        f"{name:<24} finished {row['finished']:>4}  preemptions {row['preemptions']:>5} "
        f"({row['preemptions_per_finished']:.3f}/request)  steps {row['steps']:>5}  "
        f"computed {row['computed_tokens']:>6} tokens  "
        f"{row['seconds']:6.1f} s  {row['output_tok_s']:6.1f} output tok/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 160), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"))
    p.add_argument("--num-blocks", type=int, default=48, help="blocks per cache group (the tight pool)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument(
        "--lookahead", type=int, default=None, help="reserve lookahead tokens (default: one block)"
    )
    p.add_argument("--reserve", choices=["both", "on", "off"], default="both", help="which runs to make")
    p.add_argument("--no-prefix-caching", action="store_true", help="preempted requests recompute all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warm = LLM(model=args.model, block_tokens=args.block_tokens)  # first-call costs stay out of the timings
    warm.generate([[5] * 40] * 4, SamplingParams(temperature=0, max_tokens=8))
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.reserve]
    rows, tokens = [], []
    for reserve in modes:
        row, toks = run(args, reserve)
        report(row)
        rows.append(row)
        tokens.append(toks)
    if len(tokens) == 2:
        assert tokens[0] == tokens[1], "greedy tokens differ between reserve on and off"
        print("greedy tokens identical with the reserve on and off")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "out"}, "runs": rows},
                indent=2,
                default=str,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
