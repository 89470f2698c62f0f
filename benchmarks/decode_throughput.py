"""Decode throughput: hybridserve (offline LLM, continuous batching) vs transformers generate.

transformers runs the same requests one after another at batch 1 (its padded batching is wrong for
CSA/HCA layers and its continuous batching rejects the model). Both run in this one process, one
after the other, on the same checkpoint and thread count, so the ratio is measured in one run.

    python benchmarks/decode_throughput.py --model hybridserve/assets/austen-v4 --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_ours(model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from hybridserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=len(prompts), max_num_batched_tokens=max(512, len(prompts[0]) * 2))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    with torch.no_grad():
        ref.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        tokens = 0
        for p in prompts:
            out = ref.generate(torch.tensor([p]), **kwargs)
            tokens += out.shape[1] - len(p)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="hybridserve/assets/austen-v4")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--result-json", default="benchmarks/results/decode_throughput.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    print(f"{'requests':>8} {'hybridserve tok/s':>18} {'transformers tok/s':>19} {'ratio':>7}")
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = _prompts(c, args.prompt_len, vocab, seed=c)
        ours_s, ours_tok = run_ours(args.model, prompts, args.max_tokens)
        ref_s, ref_tok = run_transformers(args.model, prompts, args.max_tokens)
        row = {"requests": c, "hybridserve_tok_s": ours_tok / ours_s, "transformers_tok_s": ref_tok / ref_s}
        row["ratio"] = row["hybridserve_tok_s"] / row["transformers_tok_s"]
        rows.append(row)
        ours, theirs = row["hybridserve_tok_s"], row["transformers_tok_s"]
        print(f"{c:>8} {ours:>18.1f} {theirs:>19.1f} {row['ratio']:>6.2f}x")
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
