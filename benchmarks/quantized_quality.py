"""Quality per memory mode on the bundled model: held-out perplexity (teacher forcing through the paged
model and its cache) and greedy agreement of an FP8 KV cache with the full-precision one.

Modes: full precision; ``hybridserve quantize --weights fp8`` and ``fp4-experts`` (kept quantized);
``--kv-cache-dtype fp8`` with full-precision weights.

    python benchmarks/quantized_quality.py --max-tokens 3000
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from hybridserve import LLM, SamplingParams
from hybridserve.cache.coordinator import KvCacheCoordinator
from hybridserve.cache.plan import build_plan
from hybridserve.cache.pool_set import BlockPoolSet
from hybridserve.config import default_model_path
from hybridserve.layers.forward_batch import ForwardBatch
from hybridserve.models.loader import load_model
from hybridserve.models.quantize import quantize_checkpoint
from hybridserve.train.data import eval_windows

BLOCK = 16


@torch.no_grad()
def heldout(folder: Path, kv_cache_dtype: str, windows: list[torch.Tensor]) -> dict[str, float]:
    """Next-token loss, perplexity and top-1 over the windows, each prefilled in one chunk."""
    model = load_model(folder, torch.float32, "cpu")
    specs = model.cache_specs(kv_cache_dtype=kv_cache_dtype)
    plan = build_plan(specs, BLOCK, 1, 512, num_blocks=2 + max(len(w) for w in windows) // BLOCK)
    pools = BlockPoolSet(plan, "cpu")
    coordinator = KvCacheCoordinator(plan, pools, enable_prefix_caching=False)
    loss = hits = n = 0.0
    for ids in windows:
        t = len(ids)
        assert coordinator.allocate("r", 0, t)
        tables = coordinator.block_tables("r")
        batch = ForwardBatch(
            input_ids=ids,
            positions=torch.arange(t),
            req_indices=torch.zeros(t, dtype=torch.long),
            seq_ends=torch.tensor([t]),
            block_tables={g: torch.tensor([b]) for g, b in tables.items()},
            block_tokens=BLOCK,
            logits_indices=torch.arange(t),
        )
        logits = model.compute_logits(model(batch, pools.tensors()))[:-1]
        coordinator.release("r")
        loss += float(F.cross_entropy(logits, ids[1:], reduction="sum"))
        hits += float((logits.argmax(-1) == ids[1:]).sum())
        n += t - 1
    return {"loss": loss / n, "perplexity": math.exp(loss / n), "top1": hits / n, "tokens": n}


def greedy_agreement(folder: Path, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(folder), kv_cache_dtype=kv, kv_cache_memory="64MiB")
        outs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), max_tokens)
        for x, y in zip(outs["auto"], outs["fp8"], strict=True)
    ]
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "identical_generations": sum(p == max_tokens for p in prefix) / len(prompts),
        "mean_tokens_before_first_difference": sum(prefix) / len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--max-tokens", type=int, default=3000, help="held-out tokens to score")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--result-json", default="benchmarks/results/quantized_quality.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    src = Path(args.model)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    text = (src / "heldout.txt").read_text()
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    bos = json.loads((src / "config.json").read_text())["bos_token_id"]
    windows = eval_windows(ids, 512, bos, args.max_tokens)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"fp8": Path(tmp) / "fp8", "fp4-experts": Path(tmp) / "fp4"}
        for mode, folder in folders.items():
            quantize_checkpoint(src, folder, mode)
        runs = [("full precision", src, "auto"), ("fp8 weights", folders["fp8"], "auto")]
        runs += [("fp4 experts (+fp8 rest)", folders["fp4-experts"], "auto"), ("fp8 kv cache", src, "fp8")]
        for name, folder, kv in runs:
            rows[name] = heldout(folder, kv, windows)
            print(name, json.dumps(rows[name]), flush=True)
    starts = range(0, len(ids) - 64, max(64, (len(ids) - 64) // args.prompts))
    prompts = [[bos, *ids[s : s + 63].tolist()] for s in list(starts)[: args.prompts]]
    agreement = greedy_agreement(src, prompts, args.generate)
    print("fp8 kv greedy agreement", json.dumps(agreement))
    out = Path(args.result_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"config": vars(args), "heldout": rows, "fp8_kv_greedy": agreement}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
