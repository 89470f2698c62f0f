"""How much a large request stalls the others: a running stream's longest inter-token gap while a big
body is posted, against its longest gap just before (same stream, same machine load).

For each body (prompt of 1.4M token ids, 131k chat messages, /tokenize of 131k messages, /detokenize of
1.3M and 400k ids, a served request for 20 prompt logprobs of 4,000 tokens: a 4 MiB answer) a stream
runs (greedy, ignore_eos, up to the context length); once it has streamed WARM chunks, its gaps over
BASELINE_S are the baseline, then the body is posted (bytes serialised up front) and the gaps until the
answer came back, plus SETTLE_S, are the stall. Reported per body: the status, the baseline's and the
stall's longest gap, and the server's hybridserve_event_loop_lag_max_seconds.

    python benchmarks/loop_stall.py --model hybridserve/assets/austen-v4 --out /tmp/loop_stall.json
    python benchmarks/loop_stall.py --base-url http://127.0.0.1:8000   # a server already running
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from hybridserve.bench.server_process import free_port, parse_metrics, stop, wait_healthy

WARM = 20
BASELINE_S = 1.5
SETTLE_S = 0.3
JSON = {"content-type": "application/json"}


@dataclass
class Stall:
    body: str
    size_bytes: int
    status: int
    baseline_max_gap_s: float
    stall_max_gap_s: float
    added_s: float
    loop_lag_max_s: float | None


def bodies(model: str) -> list[tuple[str, str, bytes]]:
    def dump(obj: object) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    messages = [{"role": "user", "content": "hi"}] * 131_000
    logprobs = {"model": model, "prompt": [5] * 4_000, "max_tokens": 1, "prompt_logprobs": 20}  # served
    return [
        (
            "completions prompt of 1.4M ids",
            "/v1/completions",
            dump({"model": model, "prompt": [5] * 1_400_000}),
        ),
        ("chat of 131k messages", "/v1/chat/completions", dump({"model": model, "messages": messages})),
        ("tokenize 131k messages", "/tokenize", dump({"model": model, "messages": messages})),
        ("detokenize 1.3M ids", "/detokenize", dump({"tokens": [5] * 1_300_000})),
        ("detokenize 400k ids", "/detokenize", dump({"tokens": [5] * 400_000})),
        ("prompt_logprobs 20 of 4,000 tokens", "/v1/completions", dump(logprobs)),
    ]


class Stream(threading.Thread):
    """A long greedy stream; records each chunk's arrival time."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.arrivals: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": self.model, "prompt": "It is a truth", "max_tokens": None, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    self.arrivals.append(time.perf_counter())
                if self.stop.is_set():
                    break

    def max_gap(self, start: float, end: float) -> float:
        times = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in itertools.pairwise(times)), default=float("nan"))


def measure(url: str, model: str, name: str, path: str, raw: bytes) -> Stall:
    stream = Stream(url, model)
    stream.start()
    while len(stream.arrivals) < WARM:
        time.sleep(0.01)
    base_start = time.perf_counter()
    time.sleep(BASELINE_S)
    sent = time.perf_counter()
    status = httpx.post(f"{url}{path}", content=raw, headers=JSON, timeout=120).status_code
    time.sleep(SETTLE_S)
    end = time.perf_counter()
    stream.stop.set()
    stream.join(timeout=120)
    baseline, stall = stream.max_gap(base_start, sent), stream.max_gap(sent, end)
    lag = parse_metrics(httpx.get(f"{url}/metrics").text).get("hybridserve_event_loop_lag_max_seconds")
    return Stall(name, len(raw), status, baseline, stall, max(0.0, stall - baseline), lag)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hybridserve/assets/austen-v4")
    ap.add_argument("--base-url", help="measure this running server instead of starting one")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    process = None
    url = args.base_url
    if url is None:
        port = free_port()
        cmd = [sys.executable, "-m", "hybridserve.cli", "serve", "--model", args.model, "--port", str(port)]
        cmd += ["--num-threads", "1", "--log-level", "warning", "--max-body-bytes", str(16 << 20)]
        process = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=300)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results = []
        for name, path, raw in bodies(model):
            results.append(measure(url, model, name, path, raw))
            r = results[-1]
            print(
                f"{r.body:34s} {r.size_bytes / 2**20:5.1f} MiB -> {r.status}: longest gap "
                f"{r.stall_max_gap_s * 1e3:7.1f} ms (baseline {r.baseline_max_gap_s * 1e3:5.1f} ms)",
                flush=True,
            )
    finally:
        if process is not None:
            stop(process)
    if args.out is not None:
        args.out.write_text(json.dumps({"results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
