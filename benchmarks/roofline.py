"""Roofline for DeepSeek-V4 decode on this machine: measured bandwidth and FLOP/s vs. bytes and FLOPs
per decoded token of a checkpoint.

Machine (torch on CPU, ``--threads``, default all cores):

* memory bandwidth: ``dst.copy_(src)`` of a large fp32 tensor (``--bw-mib`` each, far past the
  caches), counted as read + write bytes; best of several runs. A read-only figure (``src.sum()``)
  is reported too. The bounds use the copy figure (``--bound-bandwidth read`` for the other). For
  context, not as a bound: the rate one-row ``F.linear`` streams fp32 weights (a decode GEMV).
* matmul FLOP/s: ``torch.mm`` fp32 at a few square sizes, each run for ~0.3 s; the best size's
  sustained rate is used.

Checkpoint (from ``config.json`` and the safetensors headers, so on-disk dtypes and sizes count;
``--bytes-per-param`` overrides, e.g. 2 for a bf16 engine running an fp32 checkpoint). One decode
step of one sequence touches:

* every non-expert weight in full (attention projections, CSA/HCA compressors and the CSA indexer run
  for every token; routers, shared experts, hyper-connections, norms, the LM head);
* ``num_experts_per_tok`` routed experts per MoE layer;
* one row of the embedding and of the hash table ``tid2eid``;
* the KV rows it attends to at context length C (``--context``): sliding layers ``min(C, window)``
  rows of ``head_dim`` (K = V, one KV head); HCA layers that plus ``C / rate_hca`` compressed rows;
  CSA layers that plus ``min(index_topk, C / rate_csa)`` selected compressed rows and every indexer
  key (``C / rate_csa`` rows of ``index_head_dim``), which the lightning indexer scores.

FLOPs per token: 2 x every matmul weight touched (embedding and tables excluded) + attention
(4 x heads x head_dim per key attended, QK and PV) + indexer scoring (2 x index_heads x
index_head_dim per compressed key). Norms, softmaxes, Sinkhorn and the compressor pooling are left
out (small next to these).

Batch B (one decode step for B sequences, all at context C): non-expert weights are read once per
step; routed experts touched per MoE layer grow with B as the expected number of distinct experts
``E x (1 - (1 - k/E)^B)`` (uniform, independent routing; capped at all E experts); KV rows,
embedding rows and FLOPs scale with B. Upper bound on decode tok/s = B / max(bytes_per_step /
bandwidth, flops_per_step / flop_rate).

    python benchmarks/roofline.py --checkpoint data/bench-random-v4 [--threads 2] [--context 1024]

Measured runs (``--results``: run_peers.py's ``summary.json`` or bench-serve result files) are held
against the bound at their own batch (the concurrency) and mean decode context (prompt plus half the
output): *decode tok/s* = concurrency / TPOT p50 (the decode-step rate the bound describes) and the
end-to-end *output tok/s*, each with its fraction of the bound.

    python benchmarks/roofline.py --checkpoint data/bench-random-v4 --threads 1 \
        --results benchmarks/results/bench-random-v4/summary.json

Under a burst (every request sent at once), a served level's TPOT also carries the prefills of the
requests admitted after it: each token of a request that decodes while others prefill waits for their
prompt chunks. Decode steps alone are held against the bound by ``--steps``: ``profile_step.py``
result files (``--out``), each a run of plain decode steps of one batch, at its batch and mean context;
*step tok/s* = batch / median wall time of its plain steps.

    python benchmarks/profile_step.py --model data/bench-random-v4 --batch 64 --compile-decode --out s.json
    python benchmarks/roofline.py --checkpoint data/bench-random-v4 --threads 1 --steps s.json
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="DeepSeek-V4 folder (omit: machine only)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)")
    p.add_argument("--context", type=int, default=1024, help="context length C of the decoded sequences")
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes B")
    p.add_argument(
        "--bytes-per-param",
        type=float,
        default=None,
        help="weight bytes per parameter as the engine holds them (default: on-disk dtypes)",
    )
    p.add_argument(
        "--kv-bytes",
        type=float,
        default=None,
        help="bytes per KV element (default: the checkpoint's floating dtype)",
    )
    p.add_argument("--bw-mib", type=int, default=512, help="size of each bandwidth-test tensor")
    p.add_argument("--mm-sizes", default="256,512,1024,2048", help="square torch.mm sizes")
    p.add_argument("--bound-bandwidth", choices=["copy", "read"], default="copy")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    p.add_argument(
        "--results",
        type=Path,
        nargs="*",
        default=[],
        help="measured runs to hold against the bound: run_peers.py summary.json or bench-serve result files",
    )
    p.add_argument(
        "--engines", default="hybridserve,hybridserve-compiled", help="engines taken from --results"
    )
    p.add_argument(
        "--steps",
        type=Path,
        nargs="*",
        default=[],
        help="decode steps alone to hold against the bound: profile_step.py --out result files",
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------- machine


def _best_time(fn: Any, reps: int) -> float:
    fn()  # warm up (page faults, thread pool)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(mib: int) -> dict[str, float]:
    n = mib * (1 << 20) // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    t_copy = _best_time(lambda: dst.copy_(src), 6)
    t_read = _best_time(lambda: src.sum(), 6)
    nbytes = n * 4
    return {"copy_gb_s": 2 * nbytes / t_copy / 1e9, "read_gb_s": nbytes / t_read / 1e9, "tensor_mib": mib}


def measure_gemv(mib: int, rows: int = 1, out: int = 768, inner: int = 512) -> dict[str, float]:
    """What one-row ``F.linear`` streams through weights far past the caches (a decode step's GEMVs):
    the rate the BLAS reaches, not a bound."""
    weights = [torch.randn(out, inner) for _ in range(max(1, mib * (1 << 20) // (4 * out * inner)))]
    x = torch.randn(rows, inner)

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    t = _best_time(run, 3)
    return {"gemv_gb_s": sum(w.numel() * 4 for w in weights) / t / 1e9, "rows": rows, "weight_mib": mib}


def measure_matmul(sizes: list[int]) -> dict[str, Any]:
    rates: dict[str, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)
        reps, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed > 0.3 and reps >= 3:
                break
        rates[str(n)] = 2 * n**3 * reps / elapsed / 1e9
    best = max(rates, key=lambda k: rates[k])
    return {"gflop_s": rates[best], "best_size": int(best), "by_size_gflop_s": rates}


# --------------------------------------------------------------------------- checkpoint


@dataclass
class Tensor:
    name: str
    shape: list[int]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Model:
    cfg: dict[str, Any]
    tensors: list[Tensor] = field(default_factory=list)


def read_checkpoint(folder: Path) -> Model:
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "deepseek_v4":
        raise SystemExit(f"{folder}: not a DeepSeek-V4 checkpoint")
    tensors: list[Tensor] = []
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{folder}: no .safetensors files")
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            tensors.append(Tensor(name, list(meta["shape"]), end - start))
    return Model(cfg, tensors)


def _attention_rows(cfg: dict[str, Any], layer_type: str, ctx: int) -> dict[str, float]:
    """Rows read per decoded token in one layer: main KV rows, of which compressed, indexer keys."""
    window = min(ctx, int(cfg.get("sliding_window", 128)))
    rates = cfg.get("compress_rates") or {}
    if layer_type == "compressed_sparse_attention":
        n_comp = ctx // int(rates.get("compressed_sparse_attention", 4))
        return {"kv": window + min(int(cfg.get("index_topk", 512)), n_comp), "index_keys": n_comp}
    if layer_type == "heavily_compressed_attention":
        return {"kv": window + ctx // int(rates.get("heavily_compressed_attention", 128)), "index_keys": 0}
    return {"kv": window, "index_keys": 0}


def decode_profile(
    model: Model, ctx: int, bytes_per_param: float | None, kv_bytes: float | None
) -> dict[str, Any]:
    cfg = model.cfg
    n_exp = int(cfg["n_routed_experts"])
    top_k = int(cfg["num_experts_per_tok"])
    vocab = int(cfg["vocab_size"])

    def size(t: Tensor) -> float:
        return t.numel * bytes_per_param if bytes_per_param is not None else float(t.nbytes)

    shared_bytes = shared_flops = 0.0
    expert_bytes: dict[int, float] = {}  # layer -> bytes of one routed expert
    expert_flops: dict[int, float] = {}
    per_token_rows = 0.0
    params = 0
    float_sizes: list[int] = []
    for t in model.tensors:
        if t.name.startswith("mtp."):
            continue  # the MTP draft layer is not read by a plain decode step
        params += t.numel
        if t.name.endswith(".weight") and t.numel:
            float_sizes.append(t.nbytes // t.numel)
        parts = t.name.split(".")
        if ".experts." in t.name and ".shared_experts." not in t.name:
            layer = int(parts[parts.index("layers") + 1])
            expert_bytes[layer] = expert_bytes.get(layer, 0.0) + size(t) / n_exp
            expert_flops[layer] = expert_flops.get(layer, 0.0) + 2 * t.numel / n_exp
        elif "embed" in t.name or t.name.endswith("tid2eid"):
            per_token_rows += size(t) / max(t.shape[0], 1)  # one row per token
        else:
            shared_bytes += size(t)
            if len(t.shape) >= 2:
                shared_flops += 2 * t.numel

    kv_elem = kv_bytes if kv_bytes is not None else float(max(set(float_sizes), key=float_sizes.count))
    heads, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    ih, ihd = int(cfg.get("index_n_heads", 0)), int(cfg.get("index_head_dim", 0))
    kv_bytes_tok = attn_flops = 0.0
    per_layer = []
    for layer_type in cfg["layer_types"]:
        rows = _attention_rows(cfg, layer_type, ctx)
        kv_bytes_tok += rows["kv"] * hd * kv_elem + rows["index_keys"] * ihd * kv_elem
        attn_flops += 4 * heads * hd * rows["kv"] + 2 * ih * ihd * rows["index_keys"]
        per_layer.append({"type": layer_type, **rows})

    routed_bytes_tok = sum(b * top_k for b in expert_bytes.values())
    routed_flops_tok = sum(f * top_k for f in expert_flops.values())
    return {
        "params": params,
        "vocab_size": vocab,
        "routed_experts": n_exp,
        "experts_per_token": top_k,
        "moe_layers": len(expert_bytes),
        "context": ctx,
        "kv_bytes_per_element": kv_elem,
        "bytes": {
            "non_expert_weights": shared_bytes,
            "one_expert_per_layer": sum(expert_bytes.values()) / max(len(expert_bytes), 1),
            "routed_experts_per_token": routed_bytes_tok,
            "embedding_and_table_rows": per_token_rows,
            "kv_rows": kv_bytes_tok,
            "total_per_token_batch1": shared_bytes + routed_bytes_tok + per_token_rows + kv_bytes_tok,
        },
        "flops_per_token": {
            "matmul_weights": shared_flops + routed_flops_tok,
            "attention": attn_flops,
            "total": shared_flops + routed_flops_tok + attn_flops,
        },
        "attention_rows_per_layer": per_layer,
        "_expert_bytes": expert_bytes,
    }


def bounds(
    profile: dict[str, Any], bandwidth: float, flop_rate: float, batches: list[int]
) -> list[dict[str, Any]]:
    b = profile["bytes"]
    n_exp, top_k = profile["routed_experts"], profile["experts_per_token"]
    per_seq = b["embedding_and_table_rows"] + b["kv_rows"]
    flops_tok = profile["flops_per_token"]["total"]
    rows = []
    for batch in batches:
        distinct = min(float(n_exp), n_exp * (1 - (1 - top_k / n_exp) ** batch))
        expert = sum(e * distinct for e in profile["_expert_bytes"].values())
        step_bytes = b["non_expert_weights"] + expert + batch * per_seq
        t_mem = step_bytes / bandwidth
        t_compute = batch * flops_tok / flop_rate
        rows.append(
            {
                "batch": batch,
                "distinct_experts_per_layer": round(distinct, 2),
                "bytes_per_step": step_bytes,
                "bytes_per_token": step_bytes / batch,
                "memory_bound_tok_s": batch / t_mem,
                "compute_bound_tok_s": batch / t_compute,
                "upper_bound_tok_s": batch / max(t_mem, t_compute),
                "bound_by": "memory" if t_mem >= t_compute else "compute",
            }
        )
    return rows


# --------------------------------------------------------------------------- measured runs


def measured_levels(paths: list[Path], engines: set[str]) -> list[dict[str, Any]]:
    """Every measured level of ``engines`` in run_peers summaries or bench-serve result lists."""
    levels = []
    for path in paths:
        data = json.loads(path.read_text())
        runs = data["results"] if isinstance(data, dict) else [{"engine": None, "levels": data}]
        for run in runs:
            for lv in run["levels"]:
                name = run["engine"] or lv["config"].get("label", path.stem).rsplit("-c", 1)[0]
                if name in engines:
                    levels.append({"engine": name, "source": str(path), **lv})
    return levels


def achieved(
    model: Model, levels: list[dict[str, Any]], args: argparse.Namespace, bandwidth: float, flop_rate: float
) -> list[dict[str, Any]]:
    """Each level against the bound at its own batch and mean decode context (prompt + half the output).

    *decode tok/s* is concurrency / TPOT p50, the rate of the decode steps the bound describes; *output
    tok/s* is end to end (prefills and queueing included), so its fraction is a lower figure.
    """
    rows = []
    for lv in levels:
        cfg = lv["config"]
        batch, ctx = int(cfg["max_concurrency"]), int(cfg["input_len"]) + int(cfg["output_len"]) // 2
        profile = decode_profile(model, ctx, args.bytes_per_param, args.kv_bytes)
        bound = bounds(profile, bandwidth, flop_rate, [batch])[0]
        decode = batch * 1000.0 / lv["tpot_ms"]["p50"]
        upper = bound["upper_bound_tok_s"]
        rows.append(
            {
                "engine": lv["engine"],
                "batch": batch,
                "context": ctx,
                "bound_tok_s": upper,
                "bound_by": bound["bound_by"],
                "decode_tok_s": decode,
                "decode_fraction": decode / upper,
                "output_tok_s": lv["output_throughput"],
                "output_fraction": lv["output_throughput"] / upper,
                "source": lv["source"],
            }
        )
    return rows


def achieved_steps(
    model: Model, paths: list[Path], args: argparse.Namespace, bandwidth: float, flop_rate: float
) -> list[dict[str, Any]]:
    """Each profile_step.py result's plain decode steps against the bound at its batch and mean context."""
    rows = []
    for path in paths:
        run = json.loads(path.read_text())
        plain = run["unpreempted_wall_ms_per_step"]["plain"]
        batch, ctx = int(run["batch"]), int(run["context_at_phase_start"]["plain"]) + plain["n"] // 2
        profile = decode_profile(model, ctx, args.bytes_per_param, args.kv_bytes)
        bound = bounds(profile, bandwidth, flop_rate, [batch])[0]
        step_tok_s = batch * 1000.0 / plain["median"]
        rows.append(
            {
                "engine": "compiled" if run.get("compile_decode") else "eager",
                "batch": batch,
                "context": ctx,
                "bound_tok_s": bound["upper_bound_tok_s"],
                "bound_by": bound["bound_by"],
                "step_ms": plain["median"],
                "step_tok_s": step_tok_s,
                "step_fraction": step_tok_s / bound["upper_bound_tok_s"],
                "source": str(path),
            }
        )
    return rows


def _table(first: str, columns: list[tuple[str, str, str]], rows: list[dict[str, Any]]) -> str:
    """A markdown table: the engine, batch, context and bound, then ``columns`` (header, key, format;
    format "%" prints a fraction as a percentage)."""
    head = [first, "batch", "context", "bound (tok/s)", "bound by", *(c[0] for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["engine"], r["batch"], r["context"], f"{r['bound_tok_s']:.0f}", r["bound_by"]]
        cells += [f"{100 * r[key]:.1f}%" if fmt == "%" else format(r[key], fmt) for _, key, fmt in columns]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def steps_table(rows: list[dict[str, Any]]) -> str:
    columns = [("step ms (median)", "step_ms", ".1f"), ("step tok/s", "step_tok_s", ".1f")]
    return _table("decode steps", [*columns, ("fraction", "step_fraction", "%")], rows)


def achieved_table(rows: list[dict[str, Any]]) -> str:
    columns = [("decode tok/s", "decode_tok_s", ".1f"), ("fraction", "decode_fraction", "%")]
    columns += [("output tok/s", "output_tok_s", ".1f"), ("fraction", "output_fraction", "%")]
    return _table("engine", columns, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bw = measure_bandwidth(args.bw_mib)
    mm = measure_matmul([int(s) for s in args.mm_sizes.split(",")])
    bw |= measure_gemv(args.bw_mib)
    report: dict[str, Any] = {
        "threads": args.threads,
        "torch": torch.__version__,
        "bandwidth": bw,
        "matmul_fp32": mm,
    }
    if args.checkpoint is not None:
        model = read_checkpoint(args.checkpoint)
        profile = decode_profile(model, args.context, args.bytes_per_param, args.kv_bytes)
        bandwidth = (bw["copy_gb_s"] if args.bound_bandwidth == "copy" else bw["read_gb_s"]) * 1e9
        rows = bounds(profile, bandwidth, mm["gflop_s"] * 1e9, [int(b) for b in args.batches.split(",")])
        profile.pop("_expert_bytes")
        report["checkpoint"] = str(args.checkpoint)
        report["bound_bandwidth"] = args.bound_bandwidth
        report["decode"] = profile
        report["bounds"] = rows
        levels = measured_levels(args.results, set(args.engines.split(",")))
        report["achieved"] = achieved(model, levels, args, bandwidth, mm["gflop_s"] * 1e9)
        report["achieved_steps"] = achieved_steps(model, args.steps, args, bandwidth, mm["gflop_s"] * 1e9)
    text = json.dumps(report, indent=2)
    print(text)
    if args.checkpoint is not None:
        per_tok = report["decode"]["bytes"]["total_per_token_batch1"] / 1e6
        flops = report["decode"]["flops_per_token"]["total"] / 1e6
        print(
            f"bandwidth {bw['copy_gb_s']:.1f} GB/s copy ({bw['read_gb_s']:.1f} read, one-row linear "
            f"streams {bw['gemv_gb_s']:.1f}), matmul "
            f"{mm['gflop_s']:.1f} GFLOP/s; {per_tok:.1f} MB and {flops:.1f} MFLOP per token at batch 1, "
            f"context {args.context}",
            file=sys.stderr,
        )
        for r in report["bounds"]:
            print(
                f"  B={r['batch']:>3}: <= {r['upper_bound_tok_s']:8.1f} tok/s ({r['bound_by']}-bound; "
                f"{r['distinct_experts_per_layer']} experts/layer read)",
                file=sys.stderr,
            )
    if report.get("achieved"):
        print(achieved_table(report["achieved"]), file=sys.stderr)
    if report.get("achieved_steps"):
        print(steps_table(report["achieved_steps"]), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
