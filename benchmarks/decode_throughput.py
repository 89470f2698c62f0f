"""Decode throughput: hybridserve (offline LLM, continuous batching) vs transformers generate.

transformers runs the same requests one after another at batch 1 (its padded batching is wrong for
CSA/HCA layers and its continuous batching rejects the model). Both run in this one process, one
after the other, on the same checkpoint and thread count, so the ratio is measured in one run.

    python benchmarks/decode_throughput.py --model hybridserve/assets/austen-v4 --concurrency 1,4,16
    python benchmarks/decode_throughput.py --concurrency 1,16 --compile-decode   # + a compiled column
    python benchmarks/decode_throughput.py --concurrency 1,16 --compile-decode --compile-prefill

With ``--compile-decode`` hybridserve also runs with its decode steps through torch.compile; that engine
first decodes a same-sized batch of other prompts for as many tokens, so every graph the measured run
needs is compiled (and that time is reported) before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_ours(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    compiled: list[list[int]] | None = None,
    compile_prefill: bool = False,
) -> tuple[float, int, float]:
    """(seconds, tokens, compile seconds); ``compiled``: compile the decode step, warming up on these;
    ``compile_prefill``: the compiled engine's prefill steps too."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(
        model,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=max(512, len(prompts[0]) * 2),
        compile_decode=compiled is not None,
        compile_prefill=compiled is not None and compile_prefill,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(compiled or prompts[:1], params if compiled else replace(params, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    runner = getattr(llm.engine, "runner", None)
    compile_s = sum(getattr(g, "compile_seconds", 0.0) for g in _graphs(runner))
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), compile_s


def _graphs(runner: object) -> list[object]:
    """The runner's compiled-step runners (older checkouts lack the prefill one)."""
    return [g for g in (getattr(runner, "decode_graphs", None), getattr(runner, "prefill_graphs", None)) if g]


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
    parser.add_argument("--compile-decode", action="store_true", help="also measure compiled decode steps")
    parser.add_argument(
        "--compile-prefill", action="store_true", help="the compiled column compiles prefill steps too"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    print(
        f"{'requests':>8} {'hybridserve tok/s':>18} {'compiled tok/s':>15} {'transformers tok/s':>19} ratios"
    )
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = _prompts(c, args.prompt_len, vocab, seed=c)
        ours_s, ours_tok, _ = run_ours(args.model, prompts, args.max_tokens)
        row = {"requests": c, "hybridserve_tok_s": ours_tok / ours_s}
        if args.compile_decode:
            warm = _prompts(c, args.prompt_len, vocab, seed=1000 + c)
            comp_s, comp_tok, row["compile_s"] = run_ours(
                args.model, prompts, args.max_tokens, warm, args.compile_prefill
            )
            row["compiled_tok_s"] = comp_tok / comp_s
        ref_s, ref_tok = run_transformers(args.model, prompts, args.max_tokens)
        row["transformers_tok_s"] = ref_tok / ref_s
        row["ratio"] = row["hybridserve_tok_s"] / row["transformers_tok_s"]
        compiled = row.get("compiled_tok_s", float("nan"))
        row["compiled_ratio"] = compiled / row["transformers_tok_s"]
        rows.append(row)
        ours, theirs = row["hybridserve_tok_s"], row["transformers_tok_s"]
        print(
            f"{c:>8} {ours:>18.1f} {compiled:>15.1f} {theirs:>19.1f} {row['ratio']:.2f}x / "
            f"{row['compiled_ratio']:.2f}x compiled (compile {row.get('compile_s', 0):.0f} s)"
        )
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
