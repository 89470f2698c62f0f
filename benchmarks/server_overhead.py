"""What the server adds to a token: TPOT through `hybridserve serve` vs the offline step time, same run.

Offline: `LLM.generate` on one prompt at batch 1 (greedy, `--max-tokens` new tokens, ignore_eos); the
decode time per token is (total - time to the first token) / (tokens - 1). Server: the same request
streamed through `hybridserve serve` at concurrency 1; TPOT from the client's arrival times of the
chunks. Both use one torch thread (the server's engine core too) and run one after the other.

    python benchmarks/server_overhead.py --model hybridserve/assets/austen-v4 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from hybridserve.bench.server_process import free_port, wait_healthy


def offline_tpot(model: str, prompt: list[int], max_tokens: int, repeats: int) -> list[float]:
    from hybridserve import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], full)  # warm-up
    tpots = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], first)
        t1 = time.perf_counter()
        llm.generate([prompt], full)
        t2 = time.perf_counter()
        tpots.append(((t2 - t1) - (t1 - t0)) / (max_tokens - 1))
    return tpots


def server_tpot(model: str, prompt: list[int], max_tokens: int, repeats: int) -> list[float]:
    port = free_port()
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--num-threads", "1", "--log-level", "warning", "--no-enable-prefix-caching"]
    server = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout=300)
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client:
            _stream_times(client, url, body)  # warm-up
            return [_tpot(_stream_times(client, url, body)) for _ in range(repeats)]
    finally:
        server.terminate()
        server.wait(timeout=60)


def _stream_times(client: httpx.Client, url: str, body: dict) -> list[float]:
    times = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                times.append(time.perf_counter())
    return times


def _tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="hybridserve/assets/austen-v4")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--result-json", default="benchmarks/results/server_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompt = torch.randint(10, 2000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    offline = offline_tpot(args.model, prompt, args.max_tokens, args.repeats)
    served = server_tpot(args.model, prompt, args.max_tokens, args.repeats)
    result = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "offline_tpot_ms": [round(t * 1e3, 3) for t in offline],
        "server_tpot_ms": [round(t * 1e3, 3) for t in served],
        "ratio_of_medians": statistics.median(served) / statistics.median(offline),
    }
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
    off, on = statistics.median(offline) * 1e3, statistics.median(served) * 1e3
    print(f"offline {off:.2f} ms/token, server {on:.2f} ms/token at c=1: ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
