"""``hybridserve bench serve`` flags, in the spirit of ``vllm bench serve``."""

from __future__ import annotations

import argparse


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint (ours or a peer's)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to benchmark")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="OpenAI endpoint"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Bearer KEY'")
    p.add_argument("--tokenizer", default=None, help="model folder whose tokenizer shapes random prompts")
    p.add_argument(
        "--workload",
        choices=["random", "shared-prefix", "multi-turn"],
        default="random",
        help="prompt shapes",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate (max_tokens)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by this fraction")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--concurrency", default=None, help="sweep, e.g. 1,4,16,64 (overrides --max-concurrency)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and left out of the figures")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request, e.g. '{\"top_k\": 1}'")
    p.add_argument("--slo", default=None, help="goodput objective, e.g. ttft=500,tpot=50 (milliseconds)")
    p.add_argument("--label", default="run", help="name used in the JSON and the plots")
    p.add_argument("--result-json", default=None, help="write the figures to this JSON file")
    p.add_argument("--plot", default=None, help="folder for PNG plots of a concurrency sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from hybridserve.bench.soak import add_soak_args

    add_soak_args(sub.add_parser("soak", help="thousands of mixed, hostile requests; then check for leaks"))
