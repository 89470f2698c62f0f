"""Weight memory and decode throughput per weight mode, all in one run on one checkpoint.

Modes: the full-precision checkpoint loaded as bfloat16; ``hybridserve quantize --weights fp8`` and
``fp4-experts`` of it kept quantized (bfloat16 compute, each layer dequantises its weights at use);
the FP8 checkpoint dequantised at load (``--dequantize-weights``); bfloat16 weights with
``--kv-cache-dtype fp8``. For each: checkpoint bytes,
resident weight bytes (every parameter and buffer of the loaded model), the cache bytes per token
(history groups; the cache dtype follows --dtype, not the weights), and offline greedy decode tok/s at
each concurrency (continuous batching, ``ignore_eos``).

    python benchmarks/make_checkpoint.py --out /tmp/bench-random-v4
    python benchmarks/quantized_weights.py --model /tmp/bench-random-v4 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.cache.spec import GroupKind
from hybridserve.models.quantize import quantize_checkpoint


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _measure(
    folder: Path, dequantize: bool, kv_cache_dtype: str, args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"checkpoint_bytes": _checkpoint_bytes(folder)}
    for c in [int(x) for x in args.concurrency.split(",")]:
        llm = LLM(
            str(folder),
            dtype="bfloat16",
            dequantize_weights=dequantize,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=c,
            kv_cache_memory=args.kv_cache_memory,
        )
        model = llm.engine.model
        row["resident_weight_bytes"] = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
        specs = model.cache_specs(kv_cache_dtype=kv_cache_dtype)
        row["cache_bytes_per_token"] = sum(s.bytes_per_token for s in specs if s.kind == GroupKind.HISTORY)
        prompts = _prompts(c, args.prompt_len, vocab, seed=c)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row[f"decode_tok_s_c{c}"] = tokens / (time.perf_counter() - start)
        del llm
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="full-precision checkpoint")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--result-json", default="benchmarks/results/quantized_weights.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    src = Path(args.model)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"fp8": Path(tmp) / "fp8", "fp4-experts": Path(tmp) / "fp4"}
        for mode, folder in folders.items():
            quantize_checkpoint(src, folder, mode)
        runs = [
            ("bf16", src, False, "auto"),
            ("fp8", folders["fp8"], False, "auto"),
            ("fp4-experts", folders["fp4-experts"], False, "auto"),
            ("fp8, dequantised at load", folders["fp8"], True, "auto"),
            ("bf16, fp8 kv cache", src, False, "fp8"),
        ]
        for name, folder, dequantize, kv in runs:
            rows[name] = _measure(folder, dequantize, kv, args, vocab)
            print(name, json.dumps(rows[name]), flush=True)
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
