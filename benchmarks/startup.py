"""Server start-up with the default flags: how soon it answers, and how soon its compiled steps take over.

    python benchmarks/startup.py --cache-dir /tmp/ind-startup --fresh --out benchmarks/results/startup.json

Starts ``hybridserve serve`` on the bundled model (or ``--model``) with ``TORCHINDUCTOR_CACHE_DIR`` set to
``--cache-dir`` (``--fresh`` empties it first: a cold compile), then measures from the launch: seconds
until ``/health`` answers 200, until the README's completion (40 tokens) returns, and until ``/metrics``
reports ``hybridserve_full_speed`` (every compiled step ready, ``hybridserve_full_speed_seconds`` from
the engine's own start); then the same request's time at full speed, and the steps by path. Run it
twice on one cache dir for the cold and the warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from hybridserve.bench.server_process import free_port, parse_metrics, stop, wait_healthy

PROMPT = "It is a truth universally acknowledged"
ROOT = Path(__file__).resolve().parents[1]


def _complete(url: str) -> float:
    start = time.perf_counter()
    body = {"model": "austen-v4", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(args.cache_dir)
    if args.fresh:
        shutil.rmtree(cache, ignore_errors=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "hybridserve.cli", "serve", "--port", str(port), "--num-threads", "1"]
    if args.model:  # a folder named from here, found from the server's working folder (ROOT)
        argv += ["--model", str(Path(args.model).resolve()) if Path(args.model).exists() else args.model]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    launched = time.perf_counter()
    # In this script's checkout: `python -m` puts the working folder first on sys.path, so a server started
    # from another checkout would run that one's code (an A/B of two worktrees would compare one commit).
    process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, process, timeout=args.timeout)
        healthy = time.perf_counter() - launched
        first = _complete(url)
        answered = time.perf_counter() - launched
        deadline = launched + args.timeout
        while not _metrics(url).get("hybridserve_full_speed") and time.perf_counter() < deadline:
            time.sleep(1.0)
        full = time.perf_counter() - launched
        metrics = _metrics(url)
        at_speed = min(_complete(url) for _ in range(3))
        steps = _metrics(url)  # after the requests at full speed: the first ran eagerly, these compiled
    finally:
        stop(process)
    return {
        "cache": "cold" if args.fresh else "as found",
        "healthy_s": round(healthy, 1),
        "first_completion_s": round(answered, 1),
        "first_completion_request_s": round(first, 2),
        "full_speed_s": round(full, 1),
        "engine_full_speed_s": metrics.get("hybridserve_full_speed_seconds"),
        "parts_ready_s": {k: v for k, v in metrics.items() if "compiled_part_ready" in k},
        "completion_at_full_speed_s": round(at_speed, 3),
        "steps_by_path": {k: v for k, v in steps.items() if "steps_by_path_total" in k},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR of the server")
    p.add_argument("--fresh", action="store_true", help="empty the cache dir first (a cold compile)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for each stage")
    p.add_argument("--out", default=None, help="append the result to this JSON list")
    args = p.parse_args()
    result = {**measure(args), "command": " ".join(sys.argv)}
    print(json.dumps(result, indent=2))
    if args.out:
        out = Path(args.out)
        runs = json.loads(out.read_text()) if out.exists() else []
        out.write_text(json.dumps([*runs, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
