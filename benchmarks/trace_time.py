"""How long dynamo takes to trace a model's step graphs, with and without the fake-tensor dispatch cache.

    python benchmarks/trace_time.py --model <checkpoint> [--part prefill|decode] [--runs 2]

Builds ``LLM(model, ...)`` with one compiled part on (the other off), its graphs traced by dynamo's
"eager" backend (the trace alone, no inductor code generation), and prints the part's ``compile_seconds``.
Each run is a fresh process; runs alternate between dynamo's default (``fake_tensor_cache_enabled``) and
what the step graphs use (``engine/worker/graph_calls.tracing``: the cache off), so both see the same
machine load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import contextlib, json, sys
from hybridserve import LLM
from hybridserve.engine.worker import decode_graphs, prefill_graphs
model, part, cache = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
prefill_graphs.GRAPH_BACKEND = decode_graphs.GRAPH_BACKEND = "eager"
if cache:  # dynamo's default: the fake-tensor dispatch cache on while tracing
    prefill_graphs.tracing = decode_graphs.tracing = contextlib.nullcontext
llm = LLM(model, compile_decode=part == "decode", compile_prefill=part == "prefill", max_num_seqs=12,
          max_num_batched_tokens=96, max_model_len=256)
runner = llm.engine.runner.decode_graphs if part == "decode" else llm.engine.runner.prefill_graphs
print(json.dumps({"seconds": round(runner.compile_seconds, 2)}))
"""


def _run(model: str, part: str, cache: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model, part, cache], capture_output=True, text=True, check=True
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hybridserve/assets/austen-v4")
    parser.add_argument("--part", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--runs", type=int, default=2, help="pairs of runs (cache on, cache off)")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"cache on": [], "cache off": []}
    for _ in range(args.runs):
        for label, flag in (("cache on", "on"), ("cache off", "off")):
            seconds[label].append(_run(args.model, args.part, flag))
    print(json.dumps({"model": args.model, "part": args.part, "trace_seconds": seconds}))


if __name__ == "__main__":
    main()
