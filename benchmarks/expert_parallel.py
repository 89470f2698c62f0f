"""Expert parallelism: 1 rank vs N ranks (data-parallel attention, routed experts split) on one host.

Each configuration runs the same greedy requests through ``LLM`` at each concurrency (requests in flight
at once, spread over the ranks), one torch thread per rank, in this one run; it reports output tok/s,
the weight bytes each rank holds, and the time each rank spent in collectives per engine step
(dispatch + combine in every MoE layer, plus the per-step agreement).

    python benchmarks/make_checkpoint.py --out data/bench-random-v4
    python benchmarks/expert_parallel.py --model data/bench-random-v4 --ranks 1,2 --concurrency 4,16,64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _rank_stats(llm: Any) -> dict[int, tuple[float, int]]:
    client = getattr(llm.engine, "client", None)
    if client is None:
        return {0: (0.0, llm.engine.stats.steps)}
    return {r: (s.collective_s, s.steps) for r, s in client.rank_stats.items()}


def run(model: str, ranks: int, concurrency: list[int], prompt_len: int, max_tokens: int) -> list[dict]:
    from hybridserve import LLM, SamplingParams
    from hybridserve.layers.parallel_experts import weight_bytes_per_rank
    from hybridserve.models.loader import build_meta_model

    per_rank = -(-max(concurrency) // ranks)
    llm = LLM(
        model,
        data_parallel_size=ranks,
        enable_expert_parallel=ranks > 1,
        max_num_seqs=per_rank,
        max_num_batched_tokens=max(512, per_rank * 8),
        enable_prefix_caching=False,
    )
    weights = weight_bytes_per_rank(build_meta_model(model, torch.float32), ranks)
    vocab = llm.tokenizer.vocab_size if llm.tokenizer is not None else 1000
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(_prompts(ranks, 8, vocab, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rows = []
    try:
        for c in concurrency:
            before = _rank_stats(llm)
            start = time.perf_counter()
            outs = llm.generate(_prompts(c, prompt_len, vocab, c), params)
            wall = time.perf_counter() - start
            after = _rank_stats(llm)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            comm = {r: after[r][0] - before[r][0] for r in after}
            steps = {r: after[r][1] - before[r][1] for r in after}
            rows.append(
                dict(
                    ranks=ranks,
                    concurrency=c,
                    output_tok_s=tokens / wall,
                    wall_s=wall,
                    weight_bytes_per_rank=weights,
                    collective_s_per_rank=[comm[r] for r in sorted(comm)],
                    collective_ms_per_step=[1000 * comm[r] / max(steps[r], 1) for r in sorted(comm)],
                    steps_per_rank=[steps[r] for r in sorted(steps)],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="data/bench-random-v4")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--concurrency", default="4,16,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--result-json", default="benchmarks/results/expert_parallel.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # each rank process inherits it: 1 thread per rank
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for n in (int(r) for r in args.ranks.split(",")):
        rows += run(args.model, n, concurrency, args.prompt_len, args.max_tokens)
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
