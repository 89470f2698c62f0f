"""Copy a transformers DeepSeek-V4 checkpoint into a folder mlx-vlm 0.7.10 can load.

What mlx-vlm's ``deepseek_v4`` model needs beyond a ``save_pretrained`` folder:

* tensor renames: ``...attn.norm.weight`` -> ``...attn.kv_norm.weight`` (the main attention's KV norm;
  the compressors' ``.compressor.norm`` stay) and ``hc_head.hc_{fn,base,scale}`` -> ``hc_head.{...}``;
* ``config.json``: ``compress_ratios`` (one entry per layer: 0 sliding, 4 CSA, 128 HCA) and
  ``num_hash_layers`` (mlx-vlm makes the first N layers hash-routed); a YaRN ``compress`` rope becomes
  ``rope_scaling``.

mlx-vlm accepts only the compress ratios 0/4/128, so a checkpoint with other rates (the bundled
austen-v4 model uses HCA rate 16) is refused. The renames only rewrite the safetensors headers (the
tensor bytes are copied as they are), so this script needs no torch, numpy or mlx and keeps any dtype.

``--exact-indexer`` sets ``index_block`` to 0, switching off mlx-vlm's approximate hierarchical indexer
selection ("HISA", used once a CSA layer holds >= index_block * index_keep = 1024 compressed entries,
i.e. ~4k tokens); the default keeps mlx-vlm's own behaviour.

    python benchmarks/peers/mlx_vlm_convert.py SRC_DIR DST_DIR [--exact-indexer]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

RATE_OF_TYPE = {"sliding_attention": 0}
MLX_RATES = (0, 4, 128)
COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
RENAMES = (
    (re.compile(r"^(.*\.attn)\.norm\.(weight)$"), r"\1.kv_norm.\2"),
    (re.compile(r"^(.*hc_head)\.hc_(fn|base|scale)$"), r"\1.\2"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="transformers DeepSeek-V4 checkpoint folder")
    p.add_argument("dst", type=Path, help="output folder (created)")
    p.add_argument("--exact-indexer", action="store_true", help="disable mlx-vlm's HISA approximation")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    return p.parse_args(argv)


def rename(key: str) -> str:
    for pattern, repl in RENAMES:
        key = pattern.sub(repl, key)
    return key


def convert_config(cfg: dict[str, Any], exact_indexer: bool) -> dict[str, Any]:
    """The mlx-vlm config; raises SystemExit with a clear message when mlx-vlm cannot run the model."""
    if cfg.get("model_type") != "deepseek_v4":
        raise SystemExit(f"not a DeepSeek-V4 checkpoint (model_type={cfg.get('model_type')!r})")
    rates = dict(cfg.get("compress_rates") or {})
    rate_of_type = dict(RATE_OF_TYPE)
    rate_of_type["compressed_sparse_attention"] = int(rates.get("compressed_sparse_attention", 4))
    rate_of_type["heavily_compressed_attention"] = int(rates.get("heavily_compressed_attention", 128))
    layer_types = cfg.get("layer_types") or []
    n_layers = int(cfg["num_hidden_layers"])
    if len(layer_types) != n_layers:
        raise SystemExit("config.json has no per-layer `layer_types`; save it with transformers >= 5.23")
    ratios = [rate_of_type[t] for t in layer_types]
    bad = sorted({r for r in ratios if r not in MLX_RATES})
    if bad:
        raise SystemExit(
            f"mlx-vlm's deepseek_v4 supports compress rates 4 (CSA) and 128 (HCA) only; this checkpoint "
            f"uses {bad} (compress_rates={rates}). Use a 4/128 checkpoint such as the one "
            f"benchmarks/make_checkpoint.py writes."
        )
    mlp_types = cfg.get("mlp_layer_types") or ["moe"] * n_layers
    n_hash = 0
    while n_hash < len(mlp_types) and mlp_types[n_hash] == "hash_moe":
        n_hash += 1
    if "hash_moe" in mlp_types[n_hash:]:
        raise SystemExit("mlx-vlm needs the hash-routed MoE layers to be the first layers (num_hash_layers)")

    out = dict(cfg)
    out["compress_ratios"] = ratios
    out["num_hash_layers"] = n_hash
    if "qk_rope_head_dim" not in out:
        out["qk_rope_head_dim"] = int(out["head_dim"] * float(out.get("partial_rotary_factor") or 0.125))
    compress_rope = (cfg.get("rope_parameters") or {}).get("compress") or {}
    if compress_rope.get("rope_type", "default") == "yarn":
        out["rope_scaling"] = {k: v for k, v in compress_rope.items() if k not in ("rope_theta",)}
        out["rope_scaling"]["type"] = "yarn"
    elif compress_rope.get("rope_type", "default") != "default":
        raise SystemExit(f"unsupported compress rope type {compress_rope.get('rope_type')!r} for mlx-vlm")
    if exact_indexer:
        out["index_block"] = 0
    return out


def rewrite_safetensors(src: Path, dst: Path) -> int:
    """Copy one .safetensors file with renamed tensors; returns the number of renamed keys."""
    with src.open("rb") as fin, dst.open("wb") as fout:
        (header_len,) = struct.unpack("<Q", fin.read(8))
        header: dict[str, Any] = json.loads(fin.read(header_len))
        renamed = 0
        new_header: dict[str, Any] = {}
        for key, value in header.items():
            new_key = key if key == "__metadata__" else rename(key)
            renamed += new_key != key
            if new_key in new_header:
                raise SystemExit(f"{src.name}: two tensors map to {new_key!r}")
            new_header[new_key] = value
        blob = json.dumps(new_header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned
        fout.write(struct.pack("<Q", len(blob)))
        fout.write(blob)
        shutil.copyfileobj(fin, fout, length=16 << 20)
    return renamed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    src, dst = args.src, args.dst
    cfg = json.loads((src / "config.json").read_text())
    mlx_cfg = convert_config(cfg, args.exact_indexer)
    if dst.exists() and any(dst.iterdir()) and not args.force:
        raise SystemExit(f"{dst} exists and is not empty (use --force)")
    dst.mkdir(parents=True, exist_ok=True)

    renamed = 0
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            renamed += rewrite_safetensors(f, dst / f.name)
        elif f.name == "model.safetensors.index.json":
            index = json.loads(f.read_text())
            index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
            (dst / f.name).write_text(json.dumps(index, indent=2))
        elif f.name == "config.json":
            (dst / f.name).write_text(json.dumps(mlx_cfg, indent=2, ensure_ascii=False))
        elif f.is_file() and f.suffix in COPY_SUFFIXES:
            shutil.copy2(f, dst / f.name)
    summary = {
        "dst": str(dst),
        "renamed_tensors": renamed,
        "compress_ratios": mlx_cfg["compress_ratios"],
        "num_hash_layers": mlx_cfg["num_hash_layers"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
