"""Where a speculative step's time goes: trunk verify forward with its logits, rejection sampler, MTP window
KV write, MTP draft forwards (through the draft graph, which computes their logits, or eager), draft
sampling, and the rest (scheduling, commit and rollback bookkeeping). Each part is timed around a call
made outside any compiled graph (a timer inside one would break it). The engine is the
default one (compiled steps, warmed before the profile). Offline engine, c requests, fixed k; wall time
per part, summed over the steps (CPU: every op is synchronous, so wall time is where the time goes).

    python benchmarks/profile_spec_step.py --threads 1 --concurrency 1 --k 3 --output-len 64
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from spec_decode import _prompts  # benchmarks/ is on the path when run as a script

from hybridserve.config import EngineConfig, default_model_path
from hybridserve.engine.core.engine_core import EngineCore
from hybridserve.engine.request import Request, SamplingParams
from hybridserve.engine.sample.rejection_sampler import RejectionSampler
from hybridserve.engine.spec_decode.decoder import SpecDecoder
from hybridserve.engine.worker.model_runner import ModelRunner
from hybridserve.models.deepseek_v4 import DeepseekV4Model

PARTS: dict[str, tuple[Any, str]] = {
    "trunk forward and its logits": (ModelRunner, "forward"),
    "mtp forward, draft graph (+ logits)": (ModelRunner, "draft"),
    "mtp forward, eager": (DeepseekV4Model, "mtp_forward"),
    "mtp KV write": (DeepseekV4Model, "mtp_write_kv"),
    "verify (rejection sampler)": (RejectionSampler, "verify"),
    "draft sampling (+ eager logits)": (SpecDecoder, "_sample_drafts"),
}


def timed(seconds: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start

    return wrapper


def profile(model: str, c: int, k: int, temperature: float, output_len: int) -> dict[str, float]:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False} if k else None
    core = EngineCore(EngineConfig(model=model, max_num_seqs=max(c, 1), speculative_config=spec))
    core.warmup()  # compiled steps (the default) ready before the profile, as LLM(...) has them
    seconds: dict[str, float] = defaultdict(float)
    for name, (owner, attr) in PARTS.items():
        setattr(owner, attr, timed(seconds, name, getattr(owner, attr)))
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=0)
    prompts = _prompts(model, c)
    for i, p in enumerate(prompts):
        core.add_request(Request(str(i), p, params))
    core.step()  # the prefill: not profiled
    seconds.clear()
    steps, tokens, start = 0, 0, time.perf_counter()
    while core.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in core.step())
        steps += 1
    total = time.perf_counter() - start
    seconds["rest (schedule, batches, commit)"] = total - sum(seconds.values())
    seconds["total"] = total
    print(f"c={c} k={k} T={temperature}: {steps} steps, {tokens} tokens, {1000 * total / steps:.2f} ms/step")
    for name, s in seconds.items():
        print(f"  {name:<34} {1000 * s / steps:7.2f} ms/step  {100 * s / total:5.1f}%")
    print("  steps by path:", dict(core.runner.steps_by_path))
    return dict(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=default_model_path())
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    profile(args.checkpoint, args.concurrency, args.k, args.temperature, args.output_len)


if __name__ == "__main__":
    main()
