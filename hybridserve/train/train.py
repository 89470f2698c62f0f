"""Train the bundled DeepSeek-V4-architecture model (trunk + one MTP depth) on CPU.

    python -m hybridserve.train.train --out DIR [--corpus data/corpus | --train-text F --heldout F] [...]

The learning rate follows warmup + cosine decay over ``progress = max(step / steps, elapsed / minutes)``,
so a wall-clock budget still ends with an annealed model. The best-validation checkpoint is kept in ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from hybridserve.train.checkpoint import save_checkpoint
from hybridserve.train.corpus import Document, read_documents
from hybridserve.train.data import WindowSampler, encode_documents
from hybridserve.train.evaluate import HeldoutMetrics, heldout_metrics, heldout_windows
from hybridserve.train.model import PRESETS, JointModel, RouterBalancer, build_models, count_parameters
from hybridserve.train.tokenizer import SpecialIds, special_ids, train_tokenizer

LOG_NAME = "train_log.jsonl"
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_heap_memory() -> None:
    """Stop glibc from handing freed activation memory back to the OS after every step.

    On the 2-core build VM, seq-512 steps without this sometimes took 10-25 s instead of ~2 s; an 8-step
    A/B with these settings showed no such stall (not a thorough measurement).
    Equivalent to MALLOC_MMAP_THRESHOLD_=32M MALLOC_TRIM_THRESHOLD_=8G MALLOC_TOP_PAD_=512M.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        libc.mallopt(_M_TOP_PAD, 512 * 2**20)
    except (OSError, AttributeError):
        pass


class ThreadTuner:
    """Picks the intra-op thread count (``threads`` or 1) with the lower recent step time.

    When another process holds a core, 2 OpenMP threads on 2 cores run each op at the pace of the
    time-sliced thread and are slower than 1 thread; when the machine is idle 2 threads win.
    Every ``explore_every`` steps one step runs with the other setting to refresh its estimate.
    """

    def __init__(self, threads: int, explore_every: int = 20, decay: float = 0.5) -> None:
        self.options = sorted({threads, 1})
        self.seconds: dict[int, float] = {}
        self.explore_every, self.decay = explore_every, decay
        self.current = threads

    def choose(self, step: int) -> int:
        untried = [n for n in self.options if n not in self.seconds]
        if untried:
            self.current = untried[-1]
        else:
            best = min(self.seconds, key=self.seconds.__getitem__)
            explore = step % self.explore_every == 0
            self.current = next(n for n in self.options if n != best) if explore else best
        torch.set_num_threads(self.current)
        return self.current

    def record(self, seconds: float) -> None:
        old = self.seconds.get(self.current)
        self.seconds[self.current] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds


@dataclass
class Schedule:
    lr: float
    warmup: int
    steps: int
    seconds: float  # 0 = no wall-clock budget
    min_ratio: float

    def progress(self, step: int, elapsed: float) -> float:
        by_time = elapsed / self.seconds if self.seconds else 0.0
        return max(step / self.steps, by_time)

    def lr_at(self, step: int, progress: float) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)


def add_schedule_args(p: argparse.ArgumentParser, steps: int, lr: float, warmup: int) -> None:
    """The optimiser's and the schedule's flags (``Schedule``, ``make_optimizer``)."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget for the loop (0 = none)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--corpus", type=Path, help="folder with train.jsonl + heldout.txt (see corpus.py)")
    p.add_argument("--train-text", type=Path, help="plain-text training file (instead of --corpus)")
    p.add_argument("--heldout", type=Path, help="held-out text (default: CORPUS/heldout.txt)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json folder; else trained on the corpus")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--vocab-size", type=int, help="override the preset's vocabulary size")
    p.add_argument("--moe-intermediate-size", type=int, help="override the preset's expert width")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=6)
    add_schedule_args(p, steps=4000, lr=3e-3, warmup=150)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--bias-update-speed", type=float, default=1e-3, help="aux-loss-free router balancing")
    p.add_argument("--web-weight", type=float, default=0.5, help="sampling weight of Bible tokens vs Austen")
    p.add_argument("--val-every", type=int, default=150)
    p.add_argument("--val-tokens", type=int, default=0, help="held-out tokens per validation (0 = all)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fixed-threads", action="store_true", help="do not fall back to 1 thread when busy")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if (args.corpus is None) == (args.train_text is None):
        p.error("give exactly one of --corpus and --train-text")
    if args.heldout is None:
        if args.corpus is None:
            p.error("--train-text needs --heldout")
        args.heldout = args.corpus / "heldout.txt"
    return args


def load_documents(args: argparse.Namespace) -> list[Document]:
    if args.corpus is not None:
        return read_documents(args.corpus / "train.jsonl")
    return [Document("text", args.train_text.name, args.train_text.read_text(encoding="utf-8"))]


def get_tokenizer(args: argparse.Namespace, docs: list[Document]) -> Tokenizer:
    if args.tokenizer is not None:
        return Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    vocab = args.vocab_size or PRESETS[args.preset].vocab_size
    return train_tokenizer((d.text for d in docs), vocab)


def make_optimizer(joint: JointModel, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in joint.named_parameters():
        is_matrix = param.ndim >= 2 and not name.endswith("position_bias")
        (decay if is_matrix else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


class Logger:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def val_record(metrics: HeldoutMetrics) -> dict[str, float]:
    return {
        "val_loss": round(metrics.loss, 4),
        "val_mtp_loss": round(metrics.mtp_loss, 4),
        "val_ppl": round(metrics.perplexity, 2),
        "val_mtp_top1": round(metrics.mtp_top1, 4),
    }


def train(args: argparse.Namespace) -> dict[str, Any]:
    keep_heap_memory()
    # Precaution: softmax / sigmoid tails can underflow to denormals, which x86 CPUs process far slower.
    # (Not shown to matter for this model.)
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    docs = load_documents(args)
    tok = get_tokenizer(args, docs)
    ids: SpecialIds = special_ids(tok)
    spec = dataclasses.replace(PRESETS[args.preset], vocab_size=tok.get_vocab_size())
    if args.moe_intermediate_size:
        spec = dataclasses.replace(spec, moe_intermediate_size=args.moe_intermediate_size)
    config = spec.to_config(ids.bos, ids.eos, ids.pad)
    trunk, mtp = build_models(config, args.seed)
    joint = JointModel(trunk, mtp, args.mtp_weight).train()
    balancer = RouterBalancer([trunk, mtp], args.bias_update_speed)
    optimizer = make_optimizer(joint, args)
    schedule = Schedule(args.lr, args.warmup, args.steps, 60.0 * args.minutes, args.min_lr_ratio)

    streams = encode_documents(tok, docs, ids.bos)
    weights = {"web": args.web_weight}
    sampler = WindowSampler(streams, args.seq_len, ids.bos, weights, args.seed)
    heldout_text = args.heldout.read_text(encoding="utf-8")
    val = heldout_windows(tok, heldout_text, args.seq_len, ids.bos, args.val_tokens)

    logger = Logger(args.out / LOG_NAME)
    params = {"trunk": count_parameters(trunk), "mtp": count_parameters(mtp)}
    summary: dict[str, Any] = {
        "params": params,
        "train_tokens": {s.source: len(s.ids) for s in streams},
        "val_tokens": sum(len(w) - 1 for w in val),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": spec.__dict__,
    }
    logger.write({"event": "start", **summary})

    best = math.inf
    start = time.time()
    step, progress = 0, 0.0
    bar = tqdm(total=args.steps, disable=args.quiet, dynamic_ncols=True)
    tuner = None if args.fixed_threads else ThreadTuner(args.threads)
    while progress < 1.0:
        step_start = time.time()
        threads = tuner.choose(step) if tuner else args.threads
        lr = schedule.lr_at(step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        losses = joint.losses(sampler.batch(args.batch_size))
        optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(joint.parameters(), args.grad_clip)
        optimizer.step()
        balancer.step()
        if tuner:
            tuner.record(time.time() - step_start)
        step += 1
        elapsed = time.time() - start
        progress = schedule.progress(step, elapsed)
        bar.update(1)
        main_loss, mtp_loss = float(losses.main.detach()), float(losses.mtp.detach())
        bar.set_postfix(loss=f"{main_loss:.3f}", mtp=f"{mtp_loss:.3f}", best=f"{best:.3f}")
        record: dict[str, Any] = {}
        if step % args.log_every == 0:
            record = {
                "train_loss": round(main_loss, 4),
                "train_mtp_loss": round(mtp_loss, 4),
                "lr": lr,
                "router_imbalance": round(balancer.last_imbalance, 3),
                "threads": threads,
            }
        if step % args.val_every == 0 or progress >= 1.0:
            torch.set_num_threads(tuner.current if tuner else args.threads)
            metrics = heldout_metrics(joint, val)
            record.update(val_record(metrics))
            if metrics.loss < best:
                best = metrics.loss
                save_checkpoint(args.out, trunk, mtp, tok, ids)
                record["saved"] = True
        if record:
            tokens = step * args.batch_size * args.seq_len
            logger.write({"step": step, "tokens": tokens, "elapsed_s": round(elapsed, 1), **record})
    bar.close()
    summary.update({"steps": step, "wall_s": round(time.time() - start, 1), "best_val_loss": best})
    logger.write({"event": "end", **summary})
    return summary


def main(argv: list[str] | None = None) -> None:
    summary = train(parse_args(argv))
    print(json.dumps({k: summary[k] for k in ("params", "steps", "wall_s", "best_val_loss")}))


if __name__ == "__main__":
    main()
