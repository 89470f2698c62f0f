"""MTP draft acceptance per memory mode on the bundled model (offline engine, speculative decoding).

Modes as in ``quantized_quality.py``: full precision; ``hybridserve quantize --weights fp8`` and
``fp4-experts`` (kept quantized, the MTP layer quantized as the trunk is); ``--kv-cache-dtype fp8``
with full-precision weights (the MTP layer's window KV in FP8 too). Each mode runs the same held-out
prompts (word windows of ``heldout.txt``) with ``speculative_config`` {"method": "mtp",
"num_speculative_tokens": k, "adaptive": false}, greedy and at temperature 0.8, EOS ignored, and reports
the engine's own counters: draft acceptance (accepted / draft tokens) and mean acceptance length
(1 + accepted / drafts).

    python benchmarks/quantized_mtp.py --threads 1 --json benchmarks/results/quantized_mtp.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridserve.config import EngineConfig, default_model_path
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.models.quantize import quantize_checkpoint
from hybridserve.tokenizer import load_tokenizer


def prompts_of(model: Path, n: int, words: int) -> list[list[int]]:
    tok = load_tokenizer(str(model))
    assert tok is not None
    text = (model / "heldout.txt").read_text().split()
    return [tok.encode(" ".join(text[i * 211 : i * 211 + words])) for i in range(n)]


def acceptance(
    model: Path, kv: str, prompts: list[list[int]], k: int, temperature: float, n: int
) -> dict[str, Any]:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    core = EngineCore(
        EngineConfig(model=str(model), max_num_seqs=len(prompts), kv_cache_dtype=kv, speculative_config=spec)
    )
    params = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=0)
    for i, p in enumerate(prompts):
        core.add_request(Request(str(i), p, params))
    while core.has_unfinished_requests():
        core.step()
    s = core.snapshot()
    return {
        "k": k,
        "temperature": temperature,
        "drafts": s.spec_num_drafts,
        "draft_tokens": s.spec_num_draft_tokens,
        "accepted": s.spec_num_accepted_tokens,
        "acceptance": s.spec_num_accepted_tokens / max(s.spec_num_draft_tokens, 1),
        "mean_acceptance_length": 1 + s.spec_num_accepted_tokens / max(s.spec_num_drafts, 1),
        "accepted_per_pos": s.spec_accepted_per_pos,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--words", type=int, default=24)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--k", default="1,3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    src = Path(args.model)
    prompts = prompts_of(src, args.prompts, args.words)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {m: Path(tmp) / m for m in ("fp8", "fp4-experts")}
        for mode, folder in folders.items():
            quantize_checkpoint(src, folder, mode)
        modes = [("full precision", src, "auto"), ("fp8 weights", folders["fp8"], "auto")]
        modes += [("fp4 experts (+fp8 rest)", folders["fp4-experts"], "auto"), ("fp8 kv cache", src, "fp8")]
        for name, folder, kv in modes:
            for k in map(int, args.k.split(",")):
                for temperature in (0.0, 0.8):
                    row = {"mode": name, **acceptance(folder, kv, prompts, k, temperature, args.output_len)}
                    rows.append(row)
                    print(
                        f"{name:<24} k={k} T={temperature}  acceptance {row['acceptance']:.1%}  "
                        f"mean acceptance length {row['mean_acceptance_length']:.2f}",
                        flush=True,
                    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
