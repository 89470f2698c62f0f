"""Where an FP8 KV cache moves a checkpoint's logits: tests/engine/test_fp8_kv_cache.py's measure (per
position of its 60-token text, the largest logit change over the row's largest logit), then the same with
only one cached field rounded to FP8 (quantized and read back) in an otherwise full-precision cache, with
that field's largest ratio of a scale block's largest to its median magnitude (an outlier measure).

    python benchmarks/fp8_kv_error.py [--checkpoint PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer

import hybridserve.models.deepseek_v4 as dsv4
from hybridserve.config import default_model_path
from hybridserve.layers import fp8_rows
from hybridserve.models.deepseek_v4_config import DeepseekV4Config
from hybridserve.models.loader import read_config
from tests.paged import PagedSequence
from tests.tiny_models import SAMPLE_TEXT

Key = tuple[str, str, str]
write_rows = fp8_rows.write_rows
rounded: Callable[[Key], bool] = lambda key: False  # noqa: E731
block_ratio: dict[Key, float] = {}
rope_dim = 0


def _write_rows(cache: Mapping[Key, torch.Tensor], key: Key, slots: torch.Tensor, rows: torch.Tensor) -> None:
    n = rows.shape[1] - rope_dim
    nope = rows[:, :n].float()
    blocks = (
        nope.unflatten(-1, (-1, fp8_rows.SCALE_BLOCK)) if n % fp8_rows.SCALE_BLOCK == 0 else nope[:, None]
    )
    ratio = blocks.abs().amax(-1) / blocks.abs().median(-1).values.clamp(min=1e-12)
    block_ratio[key] = max(block_ratio.get(key, 0.0), float(ratio.max()))
    if rounded(key):
        q, exps = fp8_rows.quantize_rows(nope)
        rows = torch.cat([fp8_rows.dequantize_rows(q, exps, rows.dtype), rows[:, n:]], dim=-1)
    write_rows(cache, key, slots, rows)


def logits(folder: Path, ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    chunks = [len(ids) - 5, 1, 1, 1, 1, 1]  # the test's: a prefill chunk, then decode steps
    return PagedSequence(folder, torch.float32, 16, kv_cache_dtype=kv_cache_dtype).logits(ids, chunks)


def main() -> None:
    global rounded, rope_dim
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path(default_model_path()))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rope_dim = DeepseekV4Config.from_dict(read_config(args.checkpoint)).rope_head_dim
    ids = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json")).encode(SAMPLE_TEXT).ids[:60]
    dsv4.write_rows = _write_rows  # type: ignore[assignment]
    full = logits(args.checkpoint, ids)

    def report(label: str, logits: torch.Tensor) -> None:
        err = (logits - full).abs().amax(dim=-1) / full.abs().amax(dim=-1)
        worst = int(err.argmax())
        print(f"{label:<34} median {100 * err.median():5.2f}%  largest {100 * err.max():5.1f}% at {worst}")

    report("fp8 cache", logits(args.checkpoint, ids, "fp8"))
    for key in sorted(block_ratio):
        rounded = lambda k, key=key: k == key  # noqa: E731
        report(f"only {'/'.join(key)} rounded", logits(args.checkpoint, ids))
        print(f"{'':<34} block max/median {block_ratio[key]:.1f}")


if __name__ == "__main__":
    main()
