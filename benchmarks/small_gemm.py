"""Small-row fp32 GEMMs of a checkpoint's shapes on CPU: ``torch.mm`` against the alternatives a user would
reach for, each with its speed and whether it gives ``mm``'s exact bits.

* ``mm``: ``x @ W.T``, W [N, K] as the checkpoint stores it (MKL's sgemm on CPU builds);
* ``mm_input_major``: the same product with W's storage input-major (``W.T`` contiguous), the layout
  ``load_model`` gives fp32 CPU weights (``layers/weight_layout.py``);
* ``mkl_packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on a ``_mkl_reorder_linear_weight``
  packed for the row count; what inductor's weight prepacking uses);
* ``onednn``: oneDNN's linear on a reordered weight (``torch.ops.mkldnn._linear_pointwise``).

Each weight shape is timed over ``--copies`` distinct weights in turn, so that they come from memory as a
decode step's do, not from the cache. Shapes: the distinct linear weights of layer 1 plus the LM head,
from the checkpoint's safetensors headers.

    python benchmarks/small_gemm.py --checkpoint data/bench-random-v4 --rows 1,16,64 --out s.json
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch


def weight_shapes(checkpoint: Path) -> list[tuple[int, int]]:
    """Distinct 2-D weight shapes [N, K] of layer 1 and the head (routed experts once)."""
    shapes: set[tuple[int, int]] = set()
    for f in sorted(checkpoint.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            wanted = name.startswith("model.layers.1.") or name == "head.weight"
            if wanted and name.endswith("weight") and len(info["shape"]) == 2 and min(info["shape"]) > 1:
                shapes.add((int(info["shape"][0]), int(info["shape"][1])))
    return sorted(shapes)


def _time_us(call: Callable[[int], torch.Tensor], copies: int, repeats: int) -> float:
    """Mean microseconds of ``call(i)``, the weight index ``i`` turning over ``copies``."""
    for i in range(10):
        call(i % copies)
    start = time.perf_counter()
    for i in range(repeats):
        call(i % copies)
    return (time.perf_counter() - start) / repeats * 1e6


def measure(n: int, k: int, rows: int, copies: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(n * k + rows)
    weights = [torch.randn(n, k, generator=g) for _ in range(copies)]
    x = torch.randn(rows, k, generator=g)
    input_major = [w.t().contiguous().t() for w in weights]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    kinds: dict[str, Callable[[int], torch.Tensor]] = {
        "mm": lambda i: torch.mm(x, weights[i].t()),
        "mm_input_major": lambda i: torch.mm(x, input_major[i].t()),
        "mkl_packed": lambda i: torch.ops.mkl._mkl_linear(x, packed[i], weights[i], None, rows),
        "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, reordered[i], None, "none", [], ""),
    }
    out: dict = {"n": n, "k": k, "rows": rows, "weight_bytes": n * k * 4}
    reference = kinds["mm"](0)
    for name, call in kinds.items():
        us = _time_us(call, copies, repeats)
        flops = 2 * rows * n * k
        exact = torch.equal(call(0), reference)
        out[name] = {"us": us, "gflop_s": flops / us / 1e3, "exact": exact}
    out["mkl_packed"]["packed_bytes"] = packed[0].numel() * packed[0].element_size()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("data/bench-random-v4"))
    p.add_argument("--rows", default="1,16,64", help="row counts M (a decode step's tokens)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--copies", type=int, default=24, help="distinct weights per shape, timed in turn")
    p.add_argument("--repeats", type=int, default=150)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    others = ("mm_input_major", "mkl_packed", "onednn")
    print("| rows | N x K | mm us (GFLOP/s) | input-major, MKL packed, oneDNN: us, exact |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for n, k in weight_shapes(args.checkpoint):
            r = measure(n, k, rows, args.copies, args.repeats)
            results.append(r)
            mm = r["mm"]
            cells = [f"{mm['us']:.1f} ({mm['gflop_s']:.0f})"]
            cells.append("; ".join(f"{r[kind]['us']:.1f}, {r[kind]['exact']}" for kind in others))
            print(f"| {rows} | {n} x {k} | {' | '.join(cells)} |")
    if args.out:
        meta = {"checkpoint": str(args.checkpoint), "threads": args.threads, "torch": torch.__version__}
        args.out.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
