"""Co-located vs disaggregated 1 + 1 vs 2 + 2 expert-parallel, each with and without MTP: TTFT, TPOT,
throughput (``hybridserve bench serve``) and the KV handoff per request by cache group (the decode side's
/metrics). Every deployment is stood up with the commands users run (``serve``, ``launch``).

On a machine with fewer cores than processes the ranks share cores: read per-step cost and handoff cost,
not scaling.

    python benchmarks/topology.py --model hybridserve/assets/austen-v4 --out benchmarks/results/topology.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from hybridserve.bench.server_process import parse_metrics, wait_healthy

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
SHAPES = {  # name -> (command, prefill ranks, decode ranks)
    "colocated": ("serve", 0, 0),
    "1+1": ("launch", 1, 1),
    "2+2-ep": ("launch", 2, 2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(shape: str, mtp: bool, args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    command, prefill, decode = SHAPES[shape]
    engine = ["--model", args.model, "--num-threads", "1", "--max-num-seqs", "32", "--log-level", "warning"]
    engine += ["--speculative-config", MTP] if mtp else []
    if command == "serve":
        cmd = ["serve", *engine, "--port", str(port)]
    else:
        cmd = ["launch", "--prefill-dp", str(prefill), "--decode-dp", str(decode), "--port", str(port)]
        cmd += ["--prefill-port", str(_free_port()), "--decode-port", str(_free_port()), *engine]
        cmd += ["--enable-expert-parallel"] if prefill > 1 or decode > 1 else []
    argv = [sys.executable, "-m", "hybridserve.cli", *cmd]
    return subprocess.Popen(argv, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE)


def _decode_url(process: subprocess.Popen[bytes], url: str, shape: str) -> str:
    """The decode side's URL from the launcher's announcement (co-located: the server itself)."""
    if shape == "colocated":
        return url
    assert process.stdout is not None
    for line in process.stdout:
        text = line.decode()
        if text.startswith("decode: "):
            return text.split()[1]
    raise RuntimeError("the launcher did not announce its decode side")


def _bench(url: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "hybridserve.cli", "bench", "serve", "--base-url", url, "--label", label]
        cmd += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
        cmd += ["--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency)]
        cmd += ["--tokenizer", args.model, "--result-json", str(out), "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result: dict[str, Any] = json.loads(out.read_text())[0]
        return result


def _handoff(decode_url: str, num_requests: int) -> dict[str, Any]:
    m = parse_metrics(httpx.get(f"{decode_url}/metrics").text)
    by_group = {
        k.split('"')[1]: v / max(num_requests, 1)
        for k, v in m.items()
        if k.startswith("hybridserve_kv_handoff_bytes_total{")
    }
    transfers = m.get("hybridserve_kv_handoff_transfers_total", 0.0)
    seconds = m.get("hybridserve_kv_handoff_seconds_total", 0.0)
    return {
        "transfers": transfers,
        "bytes_per_request_by_group": by_group,
        "ms_per_handoff": 1000 * seconds / transfers if transfers else None,
        "spec_drafts": m.get("hybridserve_spec_decode_num_draft_tokens_total", 0.0),
        "spec_accepted": m.get("hybridserve_spec_decode_num_accepted_tokens_total", 0.0),
    }


def run(shape: str, mtp: bool, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = _start(shape, mtp, args, port)
    try:
        decode = _decode_url(process, url, shape)
        wait_healthy(url, process, timeout=900)
        label = f"{shape}{'+mtp' if mtp else ''}"
        result = _bench(url, args, label)
        return {"label": label, **result, "decode_side": _handoff(decode, args.num_prompts + 2)}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="hybridserve/assets/austen-v4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for shape in args.shapes.split(","):
        for mtp in (False, True):
            results.append(run(shape, mtp, args))
            r = results[-1]
            ttft, tpot = r["ttft_ms"]["p50"], r["tpot_ms"]["p50"]
            print(
                f"{r['label']:>14}: TTFT p50 {ttft:.1f} ms  TPOT p50 {tpot:.1f} ms  "
                f"{r['output_throughput']:.1f} tok/s  handoff {r['decode_side']}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "results": results}, indent=2))


if __name__ == "__main__":
    main()
