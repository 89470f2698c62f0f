"""``hybridserve plan``: the cache plan an engine started with these flags builds (the engine's own
``plan_cache``) and what each data-parallel rank holds; with ``--prefill-dp`` / ``--decode-dp``, the same
for each side of the deployment ``hybridserve launch`` starts from the same flags (its own parsing,
router/topology.py: each side's plan is the one its ``serve`` command line builds).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.cache.plan import CachePlan
from hybridserve.config import EngineConfig
from hybridserve.engine.worker.cache_plan import plan_cache
from hybridserve.layers.parallel_experts import expert_shards, weight_bytes_per_rank
from hybridserve.models.registry import build_meta_model, read_config
from hybridserve.router.topology import Side, add_launch_args, topology
from hybridserve.server.args import add_server_args


@dataclass
class EnginePlan:
    config: EngineConfig
    dtype: torch.dtype
    model: torch.nn.Module  # on the meta device
    plan: CachePlan
    request_tokens: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def engine_plan(config: EngineConfig) -> EnginePlan:
    raw = read_config(config.model)
    dtype = config.torch_dtype(raw.get("dtype") or raw.get("torch_dtype"))
    model = build_meta_model(config.model, dtype)
    plan = plan_cache(config, model, _local_device(config))
    length = config.max_model_len or min(model.info.max_position_embeddings, plan.max_request_tokens())
    assert isinstance(model, torch.nn.Module)
    return EnginePlan(config, dtype, model, plan, length)


def run_plan(args: argparse.Namespace) -> int:
    if args.prefill_dp is not None or args.decode_dp is not None:
        return run_topology_plan(args.argv)
    p = engine_plan(EngineConfig.from_cli(args))
    config, plan, length = p.config, p.plan, p.request_tokens
    ranks = rank_bytes(p)
    if args.json:
        report = {"model": config.model, "dtype": p.dtype_name, **plan.as_dict()}
        report |= {"request_tokens": length, "requests_that_fit": plan.requests_that_fit(length)}
        report |= {"data_parallel_size": config.data_parallel_size, "expert_parallel": config.expert_parallel}
        print(json.dumps(report | {"ranks": ranks}, indent=2))
    else:
        print(f"model: {config.model}  dtype: {p.dtype_name}")
        print(plan.describe(request_tokens=length))
        _print_rank_bytes(config, ranks)
    plan.check_usable()  # the engine refuses such a plan at start-up: say so (exit status 2)
    return 0


def _local_device(config: EngineConfig) -> torch.device | None:
    """The engine's device when this host has it (its FP8 check then runs); planning for an absent GPU
    skips only that check."""
    device = config.torch_device()
    return device if device.type == "cpu" or torch.cuda.is_available() else None


def rank_bytes(p: EnginePlan) -> list[dict[str, int]]:
    """Weights and cache each data-parallel rank holds (every rank builds the same cache plan)."""
    config, cache_bytes = p.config, p.plan.total_bytes
    n = config.data_parallel_size
    weights = weight_bytes_per_rank(p.model, n if config.expert_parallel else 1)
    per_rank = weights if config.expert_parallel else weights * n
    return [
        {"rank": r, "weight_bytes": w, "cache_bytes": cache_bytes, "total_bytes": w + cache_bytes}
        for r, w in enumerate(per_rank)
    ]


def _print_rank_bytes(config: EngineConfig, ranks: list[dict[str, int]]) -> None:
    n = config.data_parallel_size
    mode = "expert parallel" if config.expert_parallel else "replicas"
    print(f"data parallel: {n} rank{'s' if n > 1 else ''} ({mode})" if n > 1 else "single rank")
    for r in ranks:
        print(
            f"rank {r['rank']}: weights {r['weight_bytes']:,} B  cache {r['cache_bytes']:,} B  "
            f"total {r['total_bytes']:,} B"
        )


# ---- a launch topology: each side, rank by rank ------------------------------------------------------
def run_topology_plan(argv: list[str]) -> int:
    """``argv``: the plan command's flags, read as ``hybridserve launch`` reads its own."""
    parser = argparse.ArgumentParser(prog="hybridserve plan", add_help=False)
    add_launch_args(parser)
    parser.add_argument("--json", action="store_true")
    args, engine_flags = parser.parse_known_args(argv)
    top = topology(args, engine_flags)
    sides = {side.mode: engine_plan(side_config(side)) for side in (top.prefill, top.decode)}
    if args.json:
        first = next(iter(sides.values()))
        report = {"model": first.config.model, "dtype": first.dtype_name}
        print(json.dumps(report | {mode: side_report(p) for mode, p in sides.items()}, indent=2))
    else:
        for mode, p in sides.items():
            _print_side(mode, p)
    for p in sides.values():
        p.plan.check_usable()
    return 0


def side_config(side: Side) -> EngineConfig:
    """The engine config of ``side``'s ``hybridserve serve`` command line."""
    parser = argparse.ArgumentParser(prog="hybridserve serve")
    EngineConfig.add_cli_args(parser)
    add_server_args(parser)
    return EngineConfig.from_cli(parser.parse_args(side.command()[1:]))


def side_report(p: EnginePlan) -> dict[str, Any]:
    """One side's plan as plain data: the plan every rank builds, and each rank's share."""
    plan, config = p.plan, p.config
    shards = expert_shards(p.model, config.data_parallel_size) if config.expert_parallel else None
    blocks = {g.spec.name: g.usable_blocks for g in plan.groups}
    ranks = []
    for r in rank_bytes(p):
        rank: dict[str, Any] = r | {"blocks": blocks, "draft_bytes": _draft_bytes(plan)}
        if shards is not None:
            rank["experts"] = list(shards[r["rank"]])
        ranks.append(rank)
    return {
        "data_parallel_size": config.data_parallel_size,
        "expert_parallel": config.expert_parallel,
        "speculative": config.speculative is not None,
        "kv_cache_dtype": config.kv_cache_dtype,
        **plan.as_dict(),
        "draft_groups": [g.spec.name for g in plan.groups if g.spec.draft],
        "request_tokens": p.request_tokens,
        "requests_that_fit": plan.requests_that_fit(p.request_tokens),
        "ranks": ranks,
    }


def _draft_bytes(plan: CachePlan) -> int | None:
    """Bytes the draft groups' pools take (None in the page arena: they take pages as they need them)."""
    if plan.arena is not None:
        return None
    return sum(g.total_bytes for g in plan.groups if g.spec.draft)


def _print_side(mode: str, p: EnginePlan) -> None:
    report = side_report(p)
    n, ep = report["data_parallel_size"], report["expert_parallel"]
    how = f"{n} ranks ({'expert parallel' if ep else 'replicas'})" if n > 1 else "1 rank"
    print(f"== {mode} side: {how}, model {p.config.model}, {p.dtype_name}")
    print("each rank's cache plan:")
    print(p.plan.describe(request_tokens=p.request_tokens))
    draft = report["draft_groups"]
    for r in report["ranks"]:
        experts = f"experts [{r['experts'][0]}, {r['experts'][1]})  " if "experts" in r else ""
        blocks = " ".join(f"{g}={b}" for g, b in r["blocks"].items())
        mtp = ""
        if draft:
            size = "arena pages" if r["draft_bytes"] is None else f"{r['draft_bytes']:,} B"
            mtp = f" (MTP draft pools {', '.join(draft)}: {size})"
        print(
            f"rank {r['rank']}: {experts}weights {r['weight_bytes']:,} B  cache {r['cache_bytes']:,} B{mtp}  "
            f"total {r['total_bytes']:,} B  blocks {blocks}"
        )
