"""Self-distillation of the bundled model's MTP layer: fine-tune only ``mtp.0.*`` on the trunk's outputs.

    python -m hybridserve.train.corpus --out data/corpus --workdir data/debs
    python -m hybridserve.train.distill_mtp --corpus data/corpus --work data/distill --minutes 9   # repeat
    python -m hybridserve.train.distill_mtp --corpus data/corpus --work data/distill --write

The student is the MTP layer applied as the engine drafts with it (train/mtp_chain.py): depth k predicts
the token k + 1 ahead. Its target at every position is the trunk's own next-token distribution there
(KL(trunk || draft)), on corpus windows and on the trunk's greedy and T=0.8 continuations. The trunk's
streams are computed once (``--work``/sets.pt) and the trunk stays frozen: the optimizer holds only the
MTP layer's parameters, the trunk's state is hashed before and after every chunk, and ``--write`` checks
that every trunk tensor of the checkpoint is byte-identical after the new ``mtp.0.*`` are written.

Each run trains for ``--minutes`` and saves its state in ``--work``; the next run continues. The
checkpoint with the best held-out top-1 agreement is kept (``best.pt``) and is what ``--write`` writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn
from transformers import DeepseekV4ForCausalLM

from hybridserve.config import default_model_path
from hybridserve.train.checkpoint import WEIGHTS, _merge_mtp, load_mtp, load_trunk
from hybridserve.train.corpus import read_documents
from hybridserve.train.data import encode_documents
from hybridserve.train.distill_data import DistillSet, SetSizes, build_sets, heldout_stream
from hybridserve.train.model import RouterBalancer
from hybridserve.train.mtp import MTP_PREFIX, MTPModule
from hybridserve.train.mtp_chain import chain_logits

DEPTH_WEIGHTS = (1.0, 0.5, 0.25)
SAMPLED_TEMPERATURE = 0.8


def trunk_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every non-MTP tensor's name, dtype, shape and bytes (in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        if name.startswith(MTP_PREFIX):
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checkpoint_trunk_digest(folder: Path) -> str:
    return trunk_digest(load_file(str(folder / WEIGHTS)).items())


def freeze_trunk(trunk: nn.Module, mtp: MTPModule) -> list[nn.Parameter]:
    """Turn off every trunk gradient; -> the parameters a distillation step may change (MTP's only)."""
    trunk.requires_grad_(False)
    trunk.eval()
    mtp.requires_grad_(True)
    shared = {id(p) for p in trunk.parameters()}
    params = [p for p in mtp.parameters() if id(p) not in shared]
    assert params, "the MTP layer has no parameters of its own"
    return params


@torch.no_grad()
def teacher_logits(trunk: DeepseekV4ForCausalLM, streams: torch.Tensor) -> torch.Tensor:
    base = trunk.model
    out: torch.Tensor = trunk.lm_head(base.norm(base.hc_head(streams)))
    return out


def chain_and_targets(
    trunk: DeepseekV4ForCausalLM, mtp: MTPModule, ids: torch.Tensor, streams: torch.Tensor, depth: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth k: (draft logits, the trunk's logits for the same token) over every usable base."""
    drafts = chain_logits(mtp, streams, ids, depth, trunk.model.embed_tokens, trunk.lm_head)
    length = ids.shape[1] - 1
    return [(q, teacher_logits(trunk, streams[:, k:length])) for k, q in enumerate(drafts, start=1)]


def distill_loss(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum over depths of weight_k * KL(trunk || draft), mean over positions."""
    total = torch.zeros(())
    for (q, p), w in zip(pairs, DEPTH_WEIGHTS, strict=False):
        log_q = F.log_softmax(q.flatten(0, 1).float(), dim=-1)
        log_p = F.log_softmax(p.flatten(0, 1).float(), dim=-1)
        total = total + w * F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return total


def distill_step(
    trunk: DeepseekV4ForCausalLM,
    mtp: MTPModule,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    streams: torch.Tensor,
    depth: int,
) -> float:
    """One optimizer step on a batch; only the parameters ``optimizer`` holds can change."""
    mtp.train()
    loss = distill_loss(chain_and_targets(trunk, mtp, ids, streams, depth))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    return float(loss.detach())


@dataclass
class Agreement:
    """Held-out, teacher-forced: how often the draft at depth k matches the trunk."""

    kind: str
    top1: list[float]  # per depth: argmax(draft) == argmax(trunk)
    accept: list[float]  # per depth: sum_x min(p, q) at T = 0.8 (rejection sampling's acceptance)


@torch.no_grad()
def agreement(trunk: DeepseekV4ForCausalLM, mtp: MTPModule, data: DistillSet, depth: int) -> Agreement:
    mtp.eval()
    hits = [0.0] * depth
    accept = [0.0] * depth
    count = [0] * depth
    for ids, streams in zip(data.ids.split(8), data.streams.split(8), strict=True):
        for k, (q, p) in enumerate(chain_and_targets(trunk, mtp, ids, streams, depth)):
            hits[k] += float((q.argmax(-1) == p.argmax(-1)).sum())
            pq = (p / SAMPLED_TEMPERATURE).softmax(-1), (q / SAMPLED_TEMPERATURE).softmax(-1)
            accept[k] += float(torch.minimum(*pq).sum())
            count[k] += q.shape[0] * q.shape[1]
    top1 = [h / n for h, n in zip(hits, count, strict=True)]
    return Agreement(data.kind, top1, [a / n for a, n in zip(accept, count, strict=True)])


def score(results: list[Agreement]) -> float:
    """What ``best.pt`` maximises: mean top-1 agreement over the held-out continuations and depths."""
    served = [r for r in results if r.kind != "corpus"] or results
    return sum(sum(r.top1) / len(r.top1) for r in served) / len(served)


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=Path(default_model_path()))
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--work", type=Path, default=Path("data/distill"))
    ap.add_argument("--minutes", type=float, default=9.0, help="training time of this run")
    ap.add_argument("--steps", type=int, default=1500, help="total steps of the schedule")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depth", type=int, default=2, help="MTP depths trained (the engine's k)")
    ap.add_argument("--corpus-windows", type=int, default=384)
    ap.add_argument("--continuations", type=int, default=256, help="per mode (greedy, T=0.8)")
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="write best.pt's mtp.0.* into --checkpoint")
    ap.add_argument("--out", type=Path, default=None, help="with --write: a copy's folder instead")
    ap.add_argument("--evaluate", action="store_true", help="held-out agreement of --checkpoint's MTP layer")
    return ap.parse_args(argv)


def prepare_sets(args: argparse.Namespace, trunk: DeepseekV4ForCausalLM) -> dict[str, list[DistillSet]]:
    """Train and held-out sets with the trunk's streams, computed once into ``--work``/sets.pt."""
    path = args.work / "sets.pt"
    if path.exists():
        loaded: dict[str, list[DistillSet]] = torch.load(path, weights_only=False)
        return loaded
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    bos = trunk.config.bos_token_id
    assert bos is not None
    docs = read_documents(args.corpus / "train.jsonl")
    train = encode_documents(tok, docs, bos)
    sizes = SetSizes(args.corpus_windows, args.continuations)
    val_sizes = SetSizes(max(8, args.corpus_windows // 12), max(8, args.continuations // 8))
    model = str(args.checkpoint)
    heldout = heldout_stream(tok, args.checkpoint / "heldout.txt")
    sets = {
        "train": build_sets(model, trunk, train, sizes, bos, args.seed),
        "val": build_sets(model, trunk, heldout, val_sizes, bos, args.seed + 7),
    }
    args.work.mkdir(parents=True, exist_ok=True)
    torch.save(sets, path)
    return sets


def batches(sets: list[DistillSet], batch_size: int, seed: int, step: int) -> Iterator[DistillSet]:
    """Round-robin over the kinds, a random batch of each, reproducible from (seed, step)."""
    while True:
        data = sets[step % len(sets)]
        gen = torch.Generator().manual_seed(seed * 100_003 + step)
        pick = torch.randint(0, len(data.ids), (batch_size,), generator=gen)
        yield DistillSet(data.kind, data.ids[pick], data.streams[pick])
        step += 1


def train(args: argparse.Namespace) -> dict[str, Any]:
    trunk = load_trunk(args.checkpoint).eval()
    mtp = load_mtp(args.checkpoint, trunk)
    digest = trunk_digest(trunk.state_dict().items())
    sets = prepare_sets(args, trunk)
    optimizer = torch.optim.AdamW(freeze_trunk(trunk, mtp), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    balancer = RouterBalancer([mtp], 1e-3)
    state_path, best_path, log_path = args.work / "state.pt", args.work / "best.pt", args.work / "log.jsonl"
    step, best = 0, -1.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        mtp.load_state_dict(state["mtp"])
        optimizer.load_state_dict(state["optimizer"])
        step, best = state["step"], state["best"]
    else:
        best = _validate(trunk, mtp, sets["val"], args, step, log_path, best, best_path)
    _log(log_path, {"run_from_step": step, "schedule_steps": args.steps, "minutes": args.minutes})
    deadline = time.monotonic() + 60 * args.minutes
    stream = batches(sets["train"], args.batch_size, args.seed, step)
    while step < args.steps and time.monotonic() < deadline:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        batch = next(stream)
        loss = distill_step(trunk, mtp, optimizer, batch.ids, batch.streams, args.depth)
        balancer.step()
        step += 1
        if step % 10 == 0:
            _log(log_path, {"step": step, "kind": batch.kind, "loss": round(loss, 4)})
        if step % args.val_every == 0 or step == args.steps:
            best = _validate(trunk, mtp, sets["val"], args, step, log_path, best, best_path)
            torch.save(_state(mtp, optimizer, step, best), state_path)  # a killed run resumes from here
    assert trunk_digest(trunk.state_dict().items()) == digest, "a distillation step changed the trunk"
    torch.save(_state(mtp, optimizer, step, best), state_path)
    return {"step": step, "best": best}


def _state(mtp: MTPModule, optimizer: torch.optim.Optimizer, step: int, best: float) -> dict[str, Any]:
    return {"mtp": mtp.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "best": best}


def _validate(
    trunk: DeepseekV4ForCausalLM,
    mtp: MTPModule,
    val: list[DistillSet],
    args: argparse.Namespace,
    step: int,
    log_path: Path,
    best: float,
    best_path: Path,
) -> float:
    results = [agreement(trunk, mtp, data, max(args.depth, 3)) for data in val]
    value = score(results)
    record: dict[str, Any] = {"step": step, "val_score": round(value, 4)}
    for r in results:
        record[r.kind] = {
            "top1": [round(x, 4) for x in r.top1],
            "accept_t0.8": [round(x, 4) for x in r.accept],
        }
    if value > best:
        torch.save(mtp.state_dict(), best_path)
        record["saved"], best = True, value
    _log(log_path, record)
    return best


def _log(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def write(args: argparse.Namespace) -> str:
    """Write ``best.pt``'s MTP layer into the checkpoint (or a copy); every trunk tensor stays as it was."""
    folder = args.out or args.checkpoint
    if args.out is not None:
        import shutil

        shutil.copytree(args.checkpoint, folder, dirs_exist_ok=True)
    before = checkpoint_trunk_digest(folder)
    trunk = load_trunk(folder)
    mtp = MTPModule(trunk.config)
    mtp.load_state_dict(torch.load(args.work / "best.pt", weights_only=True))
    _merge_mtp(folder, mtp, torch.float32)
    after = checkpoint_trunk_digest(folder)
    assert before == after, "writing the MTP layer changed a trunk tensor"
    return after


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out agreement (per kind and depth) of the checkpoint's MTP layer, on ``--work``'s sets."""
    trunk = load_trunk(args.checkpoint).eval()
    mtp = load_mtp(args.checkpoint, trunk)
    val = prepare_sets(args, trunk)["val"]
    results = [agreement(trunk, mtp, data, max(args.depth, 3)) for data in val]
    return {"score": score(results)} | {r.kind: {"top1": r.top1, "accept_t0.8": r.accept} for r in results}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.write:
        print(json.dumps({"trunk_sha256": write(args)}))
        return
    if args.evaluate:
        print(json.dumps(evaluate(args), indent=1))
        return
    print(json.dumps(train(args)))


if __name__ == "__main__":
    main()
