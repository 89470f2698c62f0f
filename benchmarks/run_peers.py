"""hybridserve vs its peers on the same checkpoint, in one run: throughput, latency, token agreement.

    python benchmarks/run_peers.py --checkpoint hybridserve/assets/austen-v4
    python benchmarks/run_peers.py --checkpoint data/bench-random-v4 \
        --engines hybridserve,transformers,mlx-vlm
    python benchmarks/run_peers.py --checkpoint data/bench-random-v4 --threads 1 --concurrency 1,16 \
        --engines hybridserve,llama.cpp,transformers

Each engine is started on a free loopback port, driven by `hybridserve bench serve` on
`/v1/chat/completions` (the one endpoint every peer serves) at each concurrency, checked for greedy
token agreement with the transformers reference (`benchmarks/agreement.py`) at each concurrency too,
then stopped. Engines run one after another with nothing else started, so their ratios come from the
same run; every table is written by one run (there is no resuming). Each level draws fresh prompts
(seed = the level), its warm-up requests are never measured, and hybridserve's prefix cache is off for
the random workload (`--prefix-caching auto`; on for shared-prefix and multi-turn, and reported).
Needs matplotlib (`pip install -e '.[bench]'`). Peers need their venvs or builds:
`bash benchmarks/peers/setup_transformers.sh`, `bash benchmarks/peers/setup_mlx_vlm.sh`
(+ `mlx_vlm_convert.py` for the checkpoint), `bash benchmarks/peers/setup_llama_cpp.sh`
(+ `llama_cpp_convert.py CHECKPOINT CHECKPOINT.gguf` for `llama.cpp`, `CHECKPOINT-mxfp4.gguf
--experts mxfp4` for `llama.cpp-mxfp4`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from hybridserve.bench.metrics import BenchSummary
from hybridserve.bench.plot import plot_sweep
from hybridserve.bench.server_process import parse_metrics

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@dataclass
class Engine:
    name: str
    cmd: list[str]
    model_name: str
    env: dict[str, str]

    def fields(self, max_tokens: int) -> dict:
        """Request fields that make every engine return exactly ``max_tokens`` tokens."""
        if self.name.startswith("hybridserve"):
            return {"ignore_eos": True}
        if self.name == "transformers":  # transformers serve refuses ignore_eos
            return {"generation_config": json.dumps({"min_new_tokens": max_tokens})}
        if self.name.startswith("llama.cpp"):  # llama-server takes ignore_eos in chat requests too
            return {"ignore_eos": True}
        return {}  # mlx-vlm: no such option (a random model rarely emits EOS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(
    name: str,
    checkpoint: Path,
    port: int,
    threads: int,
    caching: bool,
    compile_prefill: bool = False,
    server_args: list[str] | None = None,
) -> Engine:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if name in ("hybridserve", "hybridserve-compiled"):
        cmd = [PY, "-m", "hybridserve.cli", "serve", "--model", str(checkpoint), "--port", str(port)]
        cmd += ["--num-threads", str(threads), "--log-level", "warning", "--max-num-seqs", "64"]
        cmd += [] if caching else ["--no-enable-prefix-caching"]
        cmd += ["--compile-decode"] if name == "hybridserve-compiled" else []
        cmd += ["--compile-prefill"] if compile_prefill else []
        return Engine(name, [*cmd, "--max-queue", "1024", *(server_args or [])], checkpoint.name, env)
    if name == "transformers":
        server = str(ROOT / "benchmarks/peers/transformers_server.py")
        cmd = [str(ROOT / "data/venvs/transformers/bin/python"), server, "--model", str(checkpoint)]
        return Engine(name, [*cmd, "--port", str(port), "--threads", str(threads)], str(checkpoint), env)
    if name == "mlx-vlm":
        mlx_dir = Path(str(checkpoint) + "-mlx")
        cmd = ["bash", str(ROOT / "benchmarks/peers/mlx_vlm_server.sh"), str(mlx_dir), str(port)]
        return Engine(name, cmd, str(mlx_dir), env)
    if name in LLAMA_CPP_GGUF:
        model = llama_cpp_gguf(name, checkpoint)
        cmd = ["bash", str(ROOT / "benchmarks/peers/llama_cpp_server.sh"), str(model), str(port)]
        return Engine(name, cmd, model.stem, env | {"THREADS": str(threads)})
    raise ValueError(name)


# llama.cpp engines -> the GGUF next to the checkpoint that benchmarks/peers/llama_cpp_convert.py writes
LLAMA_CPP_GGUF = {"llama.cpp": ".gguf", "llama.cpp-mxfp4": "-mxfp4.gguf"}


def llama_cpp_gguf(name: str, checkpoint: Path) -> Path:
    """``llama.cpp``: f32 experts (``--experts f32``, the reference's weights); ``llama.cpp-mxfp4``: MXFP4
    experts (``--experts mxfp4``, what llama.cpp runs for DeepSeek's own FP4 experts)."""
    return Path(str(checkpoint) + LLAMA_CPP_GGUF[name])


def _wait_ready(
    url: str, model: str, server: subprocess.Popen, log: Path, full_speed: bool, timeout: float = 3600
) -> None:
    """Until a one-token chat answers 200 and, with ``full_speed`` (hybridserve, which answers at once and
    compiles its steps in the background, cold for up to ~15 minutes on a slow CPU), until ``/metrics``
    reports ``hybridserve_full_speed``; raise at once if the server exits."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise RuntimeError(f"the server exited with {server.returncode} while starting ({log}):\n{tail}")
        try:
            if _answers(url, body) and (not full_speed or _at_full_speed(url)):
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer")


def _answers(url: str, body: dict) -> bool:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def _at_full_speed(url: str) -> bool:
    return bool(parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text).get("hybridserve_full_speed"))


def _bench(e: Engine, url: str, checkpoint: Path, args: argparse.Namespace, c: int, result: Path) -> None:
    cmd = [PY, "-m", "hybridserve.cli", "bench", "serve", "--base-url", url, "--model", e.model_name]
    cmd += [
        "--endpoint",
        "chat",
        "--tokenizer",
        str(checkpoint),
        "--num-prompts",
        str(max(args.min_prompts, c)),
    ]
    cmd += [
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--max-concurrency",
        str(c),
    ]
    cmd += ["--warmup", "2", "--no-ignore-eos", "--extra-body", json.dumps(e.fields(args.output_len))]
    cmd += ["--label", f"{e.name}-c{c}", "--result-json", str(result), "--seed", str(c), "--no-progress"]
    cmd += ["--workload", args.workload, *args.workload_args.split()]
    subprocess.run(cmd, check=True)


def _agreement(e: Engine, url: str, checkpoint: Path, args: argparse.Namespace, c: int, result: Path) -> dict:
    """Greedy agreement with ``c`` requests in flight at once (``max(agreement_prompts, c)`` prompts)."""
    cmd = [PY, str(ROOT / "benchmarks/agreement.py"), "--base-url", url, "--model", e.model_name]
    cmd += ["--checkpoint", str(checkpoint), "--endpoint", "chat", "--concurrency", str(c)]
    cmd += ["--num-prompts", str(max(args.agreement_prompts, c))]
    cmd += ["--max-tokens", "32", "--out", str(result), "--no-ignore-eos"]
    subprocess.run([*cmd, "--extra-body", json.dumps(e.fields(32))], check=True)
    return dict(json.loads(result.read_text()))


def run_engine(e: Engine, url: str, checkpoint: Path, args: argparse.Namespace, out: Path) -> dict:
    """Start the engine, measure every concurrency level and the agreement at each, stop it."""
    levels, agreement = [], {}
    log = Path(tempfile.gettempdir()) / f"run_peers-{e.name}-{os.getpid()}.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            e.cmd, env=e.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    print(f"server log: {log}", flush=True)
    try:
        _wait_ready(url, e.model_name, server, log, e.name.startswith("hybridserve"))
        for c in _levels(args):
            _bench(e, url, checkpoint, args, c, out / f"{e.name}-c{c}.json")
            levels.append(json.loads((out / f"{e.name}-c{c}.json").read_text())[0])
            if not args.skip_agreement:
                agreement[c] = _agreement(e, url, checkpoint, args, c, out / f"{e.name}-agreement-c{c}.json")
    finally:
        _stop(server)
    return {"engine": e.name, "levels": levels, "agreement": agreement}


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server alone (it drains, then stops its engine core), then its whole group: a peer
    may have children that outlive it."""
    server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=60)


def _levels(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.concurrency.split(",")]


def _throughput_by_level(results: list[dict], name: str) -> dict[int, float]:
    return {
        lv["config"]["max_concurrency"]: lv["output_throughput"]
        for r in results
        if r["engine"] == name
        for lv in r["levels"]
    }


def table(results: list[dict]) -> str:
    """One row per engine and level; the ratio columns divide each hybridserve flavour's tok/s by it."""
    ours = [n for n in ("hybridserve", "hybridserve-compiled") if any(r["engine"] == n for r in results)]
    mine = {n: _throughput_by_level(results, n) for n in ours}
    lines = [
        "| engine | concurrency | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | agreement | "
        + " | ".join(f"{n} / engine (tok/s)" for n in ours)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(ours),
    ]
    for r in results:
        for lv in r["levels"]:
            c = lv["config"]["max_concurrency"]
            agree = _agreement_figure(r["agreement"].get(c, {}))
            ratios = [mine[n].get(c, float("nan")) / lv["output_throughput"] for n in ours]
            lines.append(
                f"| {r['engine']} | {c} | {lv['output_throughput']:.1f} | {lv['ttft_ms']['p50']:.0f} / "
                f"{lv['ttft_ms']['p99']:.0f} | {lv['tpot_ms']['p50']:.1f} / {lv['tpot_ms']['p99']:.1f} | "
                f"{agree} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |"
            )
    return "\n".join(lines)


def _agreement_figure(report: dict) -> str:
    for key in ("mean_agreement", "agreement", "mean_fraction"):
        if key in report:
            return f"{report[key]:.3f}"
    return "—"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", default="hybridserve/assets/austen-v4")
    parser.add_argument("--engines", default="hybridserve,transformers")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<checkpoint name>")
    parser.add_argument(
        "--prefix-caching",
        choices=["auto", "on", "off"],
        default="auto",
        help="hybridserve's prefix cache; auto: off for the random workload, on for the others",
    )
    parser.add_argument("--workload", default="random", choices=["random", "shared-prefix", "multi-turn"])
    parser.add_argument(
        "--workload-args", default="", help="more `bench serve` flags, e.g. '--prefix-len 512'"
    )
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument(
        "--compile-prefill", action="store_true", help="hybridserve engines also compile prefill steps"
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="more `hybridserve serve` flags for hybridserve engines, e.g. '--max-num-batched-tokens 8192'",
    )
    args = parser.parse_args()
    _require_matplotlib()
    # SIGTERM (e.g. from `timeout`) unwinds like an exception, so each engine's server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    caching = args.prefix_caching == "on" or (args.prefix_caching == "auto" and args.workload != "random")
    checkpoint = Path(args.checkpoint).resolve()
    default_out = ROOT / "benchmarks/results" / checkpoint.name
    out = Path(args.out or (default_out if args.workload == "random" else default_out / args.workload))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.engines.split(","):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"== {name} on {checkpoint.name} ==", flush=True)
        e = engine(
            name, checkpoint, port, args.threads, caching, args.compile_prefill, args.server_args.split()
        )
        results.append(run_engine(e, url, checkpoint, args, out))
    config = vars(args) | {"hybridserve_prefix_caching": caching}
    (out / "summary.json").write_text(json.dumps({"config": config, "results": results}, indent=2))
    for r in results:
        points = [(lv["config"]["max_concurrency"], BenchSummary(**lv)) for lv in r["levels"]]
        plot_sweep(points, out, r["engine"])
    note = f"hybridserve prefix caching: {'on' if caching else 'off'}; one run, fresh prompts per level"
    (out / "table.md").write_text(f"{note}\n\n{table(results)}\n")
    print(note, table(results), sep="\n")


def _require_matplotlib() -> None:
    """Fail at the start, not after an hour of measuring, when the plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("run_peers.py draws plots with matplotlib: pip install -e '.[bench]'")


if __name__ == "__main__":
    main()
