"""Where a speculative step's time goes: trunk verify forward, target logits, rejection sampler, MTP window
KV write, MTP draft forwards and logits, draft sampling, and the rest (scheduling, batch building,
commit and rollback bookkeeping). Offline engine, c requests, fixed k; wall time per part, summed over
the steps (CPU: every op is synchronous, so wall time is where the time goes).

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
from hybridserve.models.deepseek_v4 import DeepseekV4Model

PARTS: dict[str, tuple[Any, str]] = {
    "trunk forward": (DeepseekV4Model, "forward"),
    "logits (target and draft)": (DeepseekV4Model, "compute_logits"),
    "mtp KV write": (DeepseekV4Model, "mtp_write_kv"),
    "mtp forward": (DeepseekV4Model, "mtp_forward"),
    "verify (rejection sampler)": (RejectionSampler, "verify"),
    "draft sampling": (RejectionSampler, "draft"),
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
