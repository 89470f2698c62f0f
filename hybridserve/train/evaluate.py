"""Held-out metrics and samples for a checkpoint folder.

python -m hybridserve.train.evaluate CHECKPOINT_DIR --heldout FILE [--max-tokens N] [--samples]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import DeepseekV4ForCausalLM

from hybridserve.train.checkpoint import load_mtp, load_trunk
from hybridserve.train.data import batched, eval_windows
from hybridserve.train.model import JointModel

DEFAULT_PROMPTS = (
    "It is a truth universally acknowledged, that",
    "Mr. Darcy",
    "Emma was",
    "In the beginning",
)


@dataclass
class HeldoutMetrics:
    tokens: int
    loss: float
    perplexity: float
    mtp_loss: float
    mtp_top1: float
    main_top1: float
    majority_baseline: float  # accuracy of always predicting the most frequent held-out token


@torch.no_grad()
def heldout_metrics(joint: JointModel, windows: list[torch.Tensor], batch_size: int = 8) -> HeldoutMetrics:
    was_training = joint.training
    joint.eval()
    sums = {"loss": 0.0, "mtp_loss": 0.0, "main_hit": 0.0, "mtp_hit": 0.0}
    n_main = n_mtp = 0
    for ids in batched(windows, batch_size):
        logits, mtp_logits = joint(ids)
        main_t, mtp_t = ids[:, 1:], ids[:, 2:]
        main_l, mtp_l = logits[:, :-1], mtp_logits[:, :-1]
        sums["loss"] += float(F.cross_entropy(main_l.flatten(0, 1), main_t.flatten(), reduction="sum"))
        sums["mtp_loss"] += float(F.cross_entropy(mtp_l.flatten(0, 1), mtp_t.flatten(), reduction="sum"))
        sums["main_hit"] += float((main_l.argmax(-1) == main_t).sum())
        sums["mtp_hit"] += float((mtp_l.argmax(-1) == mtp_t).sum())
        n_main += main_t.numel()
        n_mtp += mtp_t.numel()
    joint.train(was_training)
    targets = torch.cat([w[2:] for w in windows])
    majority = float(torch.bincount(targets).max()) / len(targets)
    loss = sums["loss"] / n_main
    return HeldoutMetrics(
        tokens=n_main,
        loss=loss,
        perplexity=math.exp(loss),
        mtp_loss=sums["mtp_loss"] / n_mtp,
        mtp_top1=sums["mtp_hit"] / n_mtp,
        main_top1=sums["main_hit"] / n_main,
        majority_baseline=majority,
    )


@torch.no_grad()
def sample(
    trunk: DeepseekV4ForCausalLM, tok: Tokenizer, prompt: str, max_new_tokens: int = 80, seed: int = 0
) -> str:
    """Sampled continuation with the checkpoint's generation defaults (temperature / top-p)."""
    torch.manual_seed(seed)
    ids = torch.tensor([tok.encode(prompt).ids])  # the tokenizer prepends bos
    mask = torch.ones_like(ids)
    out = trunk.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, attention_mask=mask)  # type: ignore[misc]
    return str(tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))


def heldout_windows(
    tok: Tokenizer, text: str, seq_len: int, bos_id: int, max_tokens: int
) -> list[torch.Tensor]:
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    return eval_windows(ids, seq_len, bos_id, max_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--heldout", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=0, help="0 = the whole held-out text")
    parser.add_argument("--samples", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    trunk = load_trunk(args.checkpoint).eval()
    joint = JointModel(trunk, load_mtp(args.checkpoint, trunk), mtp_weight=0.0)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    bos = int(trunk.config.bos_token_id)
    windows = heldout_windows(
        tok, args.heldout.read_text(encoding="utf-8"), args.seq_len, bos, args.max_tokens
    )
    report: dict[str, object] = {"heldout": asdict(heldout_metrics(joint, windows))}
    if args.samples:
        report["samples"] = {p: sample(trunk, tok, p, seed=i) for i, p in enumerate(DEFAULT_PROMPTS)}
    print(json.dumps(report, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
