"""Teach the bundled model DeepSeek-V4's conversation format: new tokens, then a short fine-tune.

    python -m hybridserve.train.finetune_chat --base hybridserve/assets/austen-v4 --corpus data/corpus \
        --out data/chat [--steps 300 --minutes 25]

The base checkpoint's tokenizer gets DeepSeek-V4's single tokens and the DSML words (``v4_tokens``), its
trunk the rows for them (``resize_vocab``). Each step then trains trunk and MTP layer together (main CE +
``--mtp-weight`` x MTP CE, as in pretraining) on ``--chat-per-step`` synthetic conversations (loss on the
last assistant turn only, ``chat_data``) and ``--prose-rows`` windows of the training corpus (every token),
so the prose is kept. The last step's checkpoint is written to ``--out`` (weights, config, tokenizer.json).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from hybridserve.tokenizer import Tokenizer
from hybridserve.train.chat_data import ChatExample, ChatMaker, sentences_by_name
from hybridserve.train.checkpoint import load_mtp, load_trunk, save_checkpoint
from hybridserve.train.corpus import read_documents
from hybridserve.train.data import WindowSampler, encode_documents
from hybridserve.train.evaluate import heldout_metrics, heldout_windows
from hybridserve.train.model import IGNORE, JointModel, RouterBalancer
from hybridserve.train.resize_vocab import resize_vocab
from hybridserve.train.tokenizer import special_ids
from hybridserve.train.train import Schedule, add_schedule_args, keep_heap_memory, make_optimizer, val_record
from hybridserve.train.v4_tokens import extend_tokenizer

LOG_NAME = "chat_finetune_log.jsonl"
KEPT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the checkpoint to start from")
    p.add_argument("--corpus", type=Path, required=True, help="folder with train.jsonl + heldout.txt")
    p.add_argument("--out", type=Path, required=True)
    add_schedule_args(p, steps=200, lr=2e-3, warmup=10)
    p.add_argument("--chat-per-step", type=int, default=6)
    p.add_argument("--prose-rows", type=int, default=2)
    p.add_argument("--prose-len", type=int, default=512)
    p.add_argument("--prose-weight", type=float, default=1.0)
    p.add_argument("--web-weight", type=float, default=0.5)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--bias-update-speed", type=float, default=1e-3)
    p.add_argument("--val-tokens", type=int, default=6000, help="held-out prose tokens per validation")
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def masked_losses(
    joint: JointModel, ids: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(main CE, MTP CE) of ``ids`` [B, S] over the tokens where ``mask`` [S] is true (all if None)."""
    logits, mtp_logits = joint(ids)
    main_t, mtp_t = ids[:, 1:].clone(), ids[:, 2:].clone()
    if mask is not None:
        main_t[:, ~mask[1:]] = IGNORE
        mtp_t[:, ~mask[2:]] = IGNORE
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1), main_t.flatten(), ignore_index=IGNORE)
    mtp = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), mtp_t.flatten(), ignore_index=IGNORE)
    return main, mtp


def target_mask(ex: ChatExample) -> torch.Tensor:
    mask = torch.zeros(len(ex.ids), dtype=torch.bool)
    for start, end in ex.targets:
        mask[start:end] = True
    return mask


def chat_loss(joint: JointModel, examples: list[ChatExample]) -> tuple[float, float]:
    """Backward of the mean loss of the examples (one at a time, no padding); (main, MTP) means."""
    main_sum = mtp_sum = 0.0
    for ex in examples:
        main, mtp = masked_losses(joint, torch.tensor([ex.ids]), target_mask(ex))
        ((main + joint.mtp_weight * mtp) / len(examples)).backward()
        main_sum, mtp_sum = main_sum + float(main.detach()), mtp_sum + float(mtp.detach())
    return main_sum / len(examples), mtp_sum / len(examples)


def prose_loss(joint: JointModel, sampler: WindowSampler, rows: int, weight: float) -> float:
    if rows == 0:
        return 0.0
    main, mtp = masked_losses(joint, sampler.batch(rows))
    (weight * (main + joint.mtp_weight * mtp)).backward()
    return float(main.detach())


def prepare(args: argparse.Namespace) -> tuple[JointModel, HFTokenizer, Path]:
    """The base model with the extended vocabulary; its tokenizer, saved in ``--out`` (read back there)."""
    tok, new = extend_tokenizer(HFTokenizer.from_file(str(args.base / "tokenizer.json")))
    trunk = load_trunk(args.base)
    mtp = load_mtp(args.base, trunk)
    resize_vocab(trunk, new, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    for name in (*KEPT_FILES, "config.json"):
        shutil.copy(args.base / name, args.out / name)
    joint = JointModel(trunk, mtp, args.mtp_weight).train()
    return joint, tok, args.out


def finetune(args: argparse.Namespace) -> dict[str, Any]:
    keep_heap_memory()
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    joint, tok, folder = prepare(args)
    ids = special_ids(tok)
    docs = read_documents(args.corpus / "train.jsonl")
    sampler = WindowSampler(
        encode_documents(tok, docs, ids.bos), args.prose_len, ids.bos, {"web": args.web_weight}, args.seed
    )
    sentences = sentences_by_name([d.text for d in docs if d.source == "austen"])
    maker = ChatMaker(Tokenizer(folder, "deepseek_v4"), sentences, random.Random(args.seed))
    val = heldout_windows(tok, (args.corpus / "heldout.txt").read_text(), 512, ids.bos, args.val_tokens)
    optimizer = make_optimizer(joint, args)
    balancer = RouterBalancer([joint.trunk, joint.mtp], args.bias_update_speed)
    schedule = Schedule(args.lr, args.warmup, args.steps, 60.0 * args.minutes, args.min_lr_ratio)
    log = (folder / LOG_NAME).open("w")
    before = val_record(heldout_metrics(joint, val))
    log.write(json.dumps({"event": "start", "args": _jsonable(vars(args)), **before}) + "\n")
    start, step, progress = time.time(), 0, 0.0
    while progress < 1.0:
        lr = schedule.lr_at(step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        chat_main, chat_mtp = chat_loss(joint, [maker.example() for _ in range(args.chat_per_step)])
        prose = prose_loss(joint, sampler, args.prose_rows, args.prose_weight)
        torch.nn.utils.clip_grad_norm_(joint.parameters(), 1.0)
        optimizer.step()
        balancer.step()
        step += 1
        progress = schedule.progress(step, time.time() - start)
        record: dict[str, Any] = {}
        if step % args.log_every == 0:
            record = {
                "chat_loss": round(chat_main, 4),
                "chat_mtp_loss": round(chat_mtp, 4),
                "prose_loss": round(prose, 4),
                "lr": lr,
            }
        if step % args.val_every == 0 or progress >= 1.0:
            record.update(val_record(heldout_metrics(joint, val)))
        if record:
            log.write(json.dumps({"step": step, "elapsed_s": round(time.time() - start, 1), **record}) + "\n")
            log.flush()
    save_checkpoint(folder, joint.trunk, joint.mtp, tok, ids)
    for name in KEPT_FILES:  # save_checkpoint writes the training tokenizer's; keep the base checkpoint's
        shutil.copy(args.base / name, folder / name)
    summary = {"event": "end", "steps": step, "wall_s": round(time.time() - start, 1)}
    log.write(json.dumps(summary) + "\n")
    return summary


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(finetune(parse_args(argv))))


if __name__ == "__main__":
    main()
