"""Prefix caching, measured: TTFT of a mostly-cached prompt vs cold, and a shared-prefix workload on vs off.

    python benchmarks/prefix_cache.py --model hybridserve/assets/austen-v4 --threads 1

Part 1 (offline engine): for each prompt length, time to first token of a prompt whose first 90%
was served just before (cached) against the same prompt after a cache reset (cold), in one run.
Part 2 (server): `hybridserve bench serve --workload shared-prefix` against a server with prefix
caching on and one with it off, started one after the other on a free port; hit rate from /metrics.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.bench.server_process import free_port, parse_metrics, wait_healthy


def ttft_cached_vs_cold(model: str, lengths: list[int], repeats: int) -> list[dict[str, float]]:
    llm = LLM(model, max_num_batched_tokens=max(lengths), max_model_len=max(lengths) + 8)
    one = SamplingParams(temperature=0, max_tokens=1)
    vocab = llm.engine.model.cfg.vocab_size
    rows = []
    for n in lengths:
        cold, warm = [], []
        for r in range(repeats):
            prompt = torch.randint(
                10, vocab, (n,), generator=torch.Generator().manual_seed(n * 100 + r)
            ).tolist()
            llm.engine.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([prompt], one)
            cold.append(time.perf_counter() - t)
            llm.engine.reset_prefix_cache()
            llm.generate([prompt[: int(n * 0.9)]], one)  # the shared 90%, served first
            t = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            warm.append(time.perf_counter() - t)
            assert out.num_cached_tokens > 0
        row = {"prompt_tokens": n, "cold_ttft_ms": 1000 * min(cold), "cached_ttft_ms": 1000 * min(warm)}
        row["speedup"] = row["cold_ttft_ms"] / row["cached_ttft_ms"]
        rows.append(row)
        print(
            f"{n:>6} tokens: cold {row['cold_ttft_ms']:8.1f} ms, 90% cached {row['cached_ttft_ms']:8.1f} ms, "
            f"{row['speedup']:.1f}x"
        )
    return rows


def shared_prefix_on_off(model: str, threads: int, bench_args: list[str]) -> dict[str, dict]:
    results = {}
    for label, flag in (
        ("caching_on", "--enable-prefix-caching"),
        ("caching_off", "--no-enable-prefix-caching"),
    ):
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridserve.cli",
                "serve",
                "--model",
                model,
                "--port",
                str(port),
                "--num-threads",
                str(threads),
                "--log-level",
                "warning",
                flag,
            ]
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url)
            out = Path(f"benchmarks/results/prefix_{label}.json")
            cmd = [
                sys.executable,
                "-m",
                "hybridserve.cli",
                "bench",
                "serve",
                "--base-url",
                url,
                "--workload",
                "shared-prefix",
                "--tokenizer",
                model,
                "--label",
                label,
                "--result-json",
                str(out),
                *bench_args,
            ]
            subprocess.run(cmd, check=True)
            metrics = _metrics(url)
            summary = json.loads(out.read_text())[0]
            summary["prefix_hit_rate"] = metrics.get("hybridserve_prefix_cache_hit_rate", 0.0)
            results[label] = summary
        finally:
            server.terminate()
            server.wait(timeout=60)
    return results


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="hybridserve/assets/austen-v4")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--bench-args",
        default="--num-prompts 64 --num-prefixes 4 --prefix-len 512 "
        "--input-len 32 --output-len 32 --max-concurrency 16",
    )
    parser.add_argument("--result-json", default="benchmarks/results/prefix_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ttft = ttft_cached_vs_cold(args.model, [int(x) for x in args.lengths.split(",")], args.repeats)
    workload = shared_prefix_on_off(args.model, args.threads, args.bench_args.split())
    on, off = workload["caching_on"], workload["caching_off"]
    print(
        f"shared-prefix: hit rate {on['prefix_hit_rate']:.2f} vs {off['prefix_hit_rate']:.2f}; output tok/s "
        f"{on['output_throughput']:.1f} vs {off['output_throughput']:.1f} "
        f"({on['output_throughput'] / off['output_throughput']:.2f}x); "
        f"TTFT p50 {on['ttft_ms']['p50']:.0f} ms vs {off['ttft_ms']['p50']:.0f} ms"
    )
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps({"ttft": ttft, "shared_prefix": workload}, indent=2))


if __name__ == "__main__":
    main()
